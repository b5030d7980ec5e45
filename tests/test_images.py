"""Images named in data (miles/models/images.py, miles/rollout/data_source.py): every form a data file may use,
every mode and format Pillow writes, and the rules a bad one meets (refused with the file, the 1-based line and
the image named, or converted and resized by the declared rule; never another exception)."""

import base64
import io
import json
import math
import os
import subprocess
import sys

import pytest
from PIL import Image

import miles.models.images as images
from miles.errors import DataError
from miles.models.images import ImageProblem, image_refs, load_image
from miles.models.hf import load_tokenizer
from miles.models.vision import ImageEncoder
from miles.rollout.data_source import encode_rows, read_rows

MODES = ["1", "L", "P", "RGB", "RGBA", "CMYK", "YCbCr", "LA", "PA", "I", "I;16", "F", "LAB", "HSV", "RGBX"]
FORMATS = ["PNG", "JPEG", "WEBP", "TIFF", "GIF", "BMP"]


def encoded(image, fmt="PNG") -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def every_saved_image():
    """(mode, format, bytes) of a 16x12 image of every mode in every format Pillow writes it in."""
    for mode in MODES:
        image = Image.new(mode, (16, 12))
        for fmt in FORMATS:
            try:
                yield mode, fmt, encoded(image, fmt)
            except (OSError, ValueError, KeyError):
                continue  # Pillow does not write this mode in this format


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_every_mode_and_format_reads_as_rgb_or_is_refused_by_name(tmp_path):
    read = refused = 0
    for mode, fmt, data in every_saved_image():
        path = tmp_path / f"{mode.replace(';', '_')}.{fmt.lower()}"
        path.write_bytes(data)
        try:
            loaded = load_image(path.name, tmp_path)
        except ImageProblem as exc:  # a file Pillow wrote and cannot read back: said, never raised as another error
            assert str(path) in str(exc), exc
            refused += 1
            continue
        assert loaded.image.mode == "RGB" and loaded.size == (16, 12), (mode, fmt)
        read += 1
    assert read >= 50 and refused <= 3


@pytest.mark.parametrize("mode, value, expected", [
    ("RGBA", (0, 0, 0, 0), (255, 255, 255)),  # transparent: composited on white
    ("RGBA", (10, 20, 30, 255), (10, 20, 30)),
    ("LA", (0, 0), (255, 255, 255)),
    ("L", 200, (200, 200, 200)),
    ("I;16", 65535, (255, 255, 255)),  # 16 bits scaled to 8
    ("I;16", 32768, (128, 128, 128)),
    ("I", 65535, (255, 255, 255)),
])
def test_modes_are_converted_by_the_declared_rule(tmp_path, mode, value, expected):
    (tmp_path / "a.png").write_bytes(encoded(Image.new(mode, (8, 8), value)))
    assert load_image("a.png", tmp_path).image.getpixel((3, 3)) == expected


def test_a_palette_image_with_a_transparent_colour_is_composited_on_white(tmp_path):
    image = Image.new("P", (8, 8), 1)
    image.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    image.info["transparency"] = 1
    (tmp_path / "p.png").write_bytes(encoded(image))
    assert load_image(str(tmp_path / "p.png")).image.getpixel((0, 0)) == (255, 255, 255)


def test_every_way_of_naming_an_image(tmp_path):
    data = encoded(Image.new("RGB", (8, 6), (1, 2, 3)))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.png").write_bytes(data)
    b64 = base64.b64encode(data).decode()
    for ref, base in [("sub/a.png", tmp_path), (str(tmp_path / "sub" / "a.png"), None),
                      (f"file://{tmp_path / 'sub' / 'a.png'}", None), (f"data:image/png;base64,{b64}", None),
                      (b64, None), ("\n".join(b64[i:i + 76] for i in range(0, len(b64), 76)), None)]:
        loaded = load_image(ref, base)
        assert loaded.size == (8, 6) and loaded.image.getpixel((0, 0)) == (1, 2, 3), ref


def test_a_huge_image_is_scaled_down_to_max_pixels_keeping_its_shape(tmp_path):
    (tmp_path / "big.png").write_bytes(encoded(Image.new("RGB", (4000, 3000), (5, 5, 5))))
    loaded = load_image("big.png", tmp_path)
    width, height = loaded.size
    assert width * height <= images.MAX_PIXELS < 4000 * 3000 and loaded.resized_from == (4000, 3000)
    assert math.isclose(width / height, 4 / 3, rel_tol=0.01)
    small = load_image("big.png", tmp_path, max_pixels=40_000)
    assert small.size[0] * small.size[1] <= 40_000


def test_an_image_too_large_to_decode_is_refused_before_decoding(tmp_path, monkeypatch):
    (tmp_path / "bomb.png").write_bytes(encoded(Image.new("RGB", (300, 300))))
    monkeypatch.setattr(images, "MAX_DECODE_PIXELS", 300 * 299)
    with pytest.raises(ImageProblem, match=r"300x300 pixels, more than the 89700 an image may have to be decoded"):
        load_image("bomb.png", tmp_path)


@pytest.mark.parametrize("ref, message", [
    ("missing.png", r"missing.png: no such file \(a relative path is taken from the data file's folder\)"),
    ("https://example.com/a.png", "web URLs are not fetched"),
    ("data:image/png,abc", r"expected data:image/...;base64,<base64 of the file>"),
    ("data:image/png;base64,@@@", "data URL: not valid base64"),
    (7, r"expected an image as a path, a data: URL, base64 text or \(from an environment\) a PIL image, got 7"),
    ("", r"expected an image as a path, a data: URL, base64 text or \(from an environment\) a PIL image, got ''"),
    (None, "got None"),
    ("aGVsbG8gd29ybGQ=", r"base64 image \(16 characters\): not an image file"),
])
def test_bad_references_are_refused_with_what_was_expected(tmp_path, ref, message):
    with pytest.raises(ImageProblem, match=message):
        load_image(ref, tmp_path)


def test_bad_files_are_refused_never_half_read(tmp_path):
    data = encoded(Image.new("RGB", (64, 64), (9, 9, 9)))
    (tmp_path / "truncated.png").write_bytes(data[: len(data) // 2])
    (tmp_path / "text.png").write_text("not an image")
    (tmp_path / "tiny.png").write_bytes(encoded(Image.new("RGB", (3, 40))))
    for name, message in [("truncated.png", "not a readable image"), ("text.png", "not an image file"),
                          ("tiny.png", "3x40 pixels; expected at least 4 on each side")]:
        with pytest.raises(ImageProblem, match=message):
            load_image(name, tmp_path)


def test_image_parts_in_the_forms_of_openai_and_hf():
    prompt = [{"role": "system", "content": "plain text"},
              {"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": "hi"},
                                           {"type": "image_url", "image_url": {"url": "data:x"}},
                                           {"type": "image_url", "image_url": "b.png"},
                                           {"type": "image", "url": "c.png"}, {"type": "image", "path": "d.png"},
                                           {"type": "image"}]}]
    assert image_refs(prompt) == ["a.png", "data:x", "b.png", "c.png", "d.png", None]
    assert image_refs("text") == image_refs([{"role": "user", "content": "text"}]) == []


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_bad_images_in_a_data_file_are_named_by_line_and_image(tmp_path):
    (tmp_path / "ok.png").write_bytes(encoded(Image.new("RGB", (8, 8))))
    (tmp_path / "bad.png").write_text("nope")
    good = {"prompt": [{"role": "user", "content": [{"type": "image", "image": "ok.png"}]}], "label": "1"}
    bad = {"prompt": [{"role": "user", "content": [{"type": "image", "image": "ok.png"},
                                                   {"type": "image", "image": "bad.png"}]}], "label": "2"}
    missing = {"prompt": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "gone.png"}}]}]}
    write_rows(tmp_path / "data.jsonl", [good, bad, {"prompt": "text only"}, missing])
    with pytest.raises(DataError) as raised:
        read_rows(tmp_path / "data.jsonl", "prompt", None)
    message = str(raised.value)
    assert "2 image(s) cannot be read" in message
    assert f"line 2, image 2 of the prompt: {tmp_path / 'bad.png'}: not an image file" in message
    assert f"line 4, image 1 of the prompt: {tmp_path / 'gone.png'}: no such file" in message


def test_images_are_refused_for_a_text_only_model_and_read_for_a_vision_language_model(tmp_path, vlm_model_dir,
                                                                                      tiny_model_dir):
    (tmp_path / "ok.png").write_bytes(encoded(Image.new("RGB", (56, 56), "red")))
    image = {"prompt": [{"role": "user", "content": [{"type": "image", "image": "ok.png"},
                                                     {"type": "text", "text": "Colour?"}]}], "label": "red"}
    write_rows(tmp_path / "data.jsonl", [{"prompt": "2+2=", "label": "4"}, image])
    with pytest.raises(DataError, match=r"data.jsonl', line 2: the prompt holds images \(1 prompt\(s\) of the file do\)"
                                        r", and the model is text-only \(its config has no vision tower\)"):
        read_rows(tmp_path / "data.jsonl", "prompt", None)

    rows = read_rows(tmp_path / "data.jsonl", "prompt", None, images=True)
    tokenizer = load_tokenizer(vlm_model_dir)
    text, pictured = encode_rows(rows, tokenizer, prompt_key="prompt", label_key="label", chat_template="auto",
                                 images=ImageEncoder.of(vlm_model_dir))
    assert text.images == () and len(pictured.images) == 1
    image_pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert pictured.prompt_ids.count(image_pad) == 4  # 56x56 pixels: 2x2 merged patches, widened from one pad
    assert pictured.images[0].ref == str((tmp_path / "ok.png").resolve())  # what the engine is sent
    assert ImageEncoder.of(tiny_model_dir) is None  # a text-only model: its data may hold no images


def test_miles_train_exits_2_naming_the_bad_image(tmp_path):
    image = [{"role": "user", "content": [{"type": "image", "image": "x.png"}]}]
    write_rows(tmp_path / "data.jsonl", [{"prompt": "1+1=", "label": "2"}, {"prompt": image, "label": "3"}])
    result = subprocess.run([sys.executable, "-m", "miles", "train", "configs/quickstart.yaml",
                             f"run.dir={tmp_path / 'run'}", f"data.train_path={tmp_path / 'data.jsonl'}",
                             "data.generator=null", "run.progress=false"],
                            capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"line 2, image 1 of the prompt: {tmp_path / 'x.png'}: no such file" in result.stderr
    assert not (tmp_path / "run").exists()
