"""Token-exact chat turns: the tokens of new messages are the suffix of the chat template's rendering that follows
the tokens the trajectory already holds.

The policy's own turns are never re-rendered into tokens: the trajectory keeps the generated ids. Each time
messages are added (and once more when the trajectory ends, :meth:`Conversation.finish`), the template's rendering
of the whole conversation is held against the trajectory's own tokens, as text: the prompt and every suffix as they
were rendered, and each generated turn as its tokens decode. The rendering must begin with exactly that text; the
new tokens are the rest. A template that renders what the trajectory holds differently (drops earlier reasoning,
moves the system prompt, trims what the policy generated, re-renders a tool call's arguments, ...) is reported
with the message and the first token that differs (:class:`NotAppendOnly`); what follows is
``rollout.tito.on_mismatch``'s choice. So a template is either exact for a trajectory or loud, never silently
different from how a deployed model would see the conversation.

A vision-language model's messages may hold images (:mod:`miles.models.images`): the template renders each as one
image span, which the conversation widens to the image's tokens (:class:`~miles.models.vision.ImageEncoder`);
:attr:`Conversation.images` holds every image of its tokens, in order.
"""

from __future__ import annotations

import copy
from typing import Any

from miles.agentic.chat_format import BoundFormat, for_tokenizer
from miles.agentic.types import Message
from miles.models.images import ImageProblem, image_refs
from miles.models.vision import ImageEncoder, ProcessedImage, expand_images

__all__ = ["Conversation", "NotAppendOnly", "first_differing_token", "normalize_messages"]


class NotAppendOnly(ValueError):
    """The chat template renders the conversation differently from the tokens the trajectory holds.

    ``message_index``: the message whose rendering differs; ``token_index``: the first differing token of the
    trajectory's tokens (counting the prompt's); ``after``: the rendering with the new messages (for a re-render);
    ``final``: found when the trajectory ended (:meth:`Conversation.finish`), with nothing more to add.
    """

    def __init__(self, reason: str, *, message_index: int = -1, token_index: int = -1, after: str = "",
                 final: bool = False) -> None:
        super().__init__(reason)
        self.message_index, self.token_index, self.after, self.final = message_index, token_index, after, final


def first_differing_token(held: list[int], rendered: list[int]) -> int:
    """The index of the first token where ``rendered`` (a re-rendering) differs from ``held`` (a trajectory's)."""
    return next((i for i, (a, b) in enumerate(zip(held, rendered)) if a != b), min(len(held), len(rendered)))


def normalize_messages(observation: Any, role: str) -> list[Message]:
    """An observation (messages, one message, a string, or None) as a list of messages; a string becomes
    one message with ``role``."""
    if observation is None:
        return []
    if isinstance(observation, str):
        return [{"role": role, "content": observation}]
    if isinstance(observation, dict):
        observation = [observation]
    if not isinstance(observation, list) or not all(isinstance(m, dict) and "role" in m for m in observation):
        raise TypeError(f"an observation must be chat messages (dicts with 'role'), one message, a string or None; "
                        f"got {type(observation).__name__}: {str(observation)[:200]}")
    return [dict(m) for m in observation]


class Conversation:
    """The messages of one trajectory and how they map to tokens, in one chat format.

    ``prompt_ids`` is the rendering of the first messages with the generation prompt. After each policy
    turn, :meth:`add_policy_turn` records the message that the generated tokens stand for (and those tokens), and
    :meth:`extend` returns the tokens of the next messages plus the next generation prompt.

    ``images``: a vision-language model's encoder (None: messages may hold no images); ``held``: the first
    messages' images as already read (a data file's, whose relative paths only its reader can resolve).
    """

    def __init__(self, fmt: BoundFormat | Any, messages: list[Message], tools: list[dict[str, Any]] | None = None,
                 images: ImageEncoder | None = None, held: list[ProcessedImage] | tuple[ProcessedImage, ...] = ()
                 ) -> None:
        if not isinstance(fmt, BoundFormat):  # a tokenizer: the builtin format it speaks, with its own template
            fmt = for_tokenizer(fmt)
        self.format, self.tokenizer, self.tools = fmt, fmt.tokenizer, tools or None
        self.messages: list[Message] = list(messages)
        self.encoder, self.images = images, list[ProcessedImage]()
        self.policy_turns = 0
        self._cut = False  # whether the policy's last turn stopped at its token limit
        images = self._read(self.messages, 0, list(held) or None)  # before rendering: a template may not take them
        rendered = self.render(self.messages, generation_prompt=True)
        self.prompt_ids = self._widen(self.encode(rendered), images)
        # The trajectory's tokens as text: what was rendered for them, and each generated turn as it decodes (image
        # spans as the template renders them, one each); ``_turns``: where each policy turn's text starts in it
        self.text = rendered
        self._turns: list[int] = []
        self._open = True  # the text ends with a generation prompt

    @property
    def eot_text(self) -> str:
        """The token text that closes a policy turn in the rendered history."""
        return self.format.format.end_of_turn[0]

    @property
    def eot_id(self) -> int:
        """The token that closes a policy turn in the rendered history (the format's first end-of-turn)."""
        return self.tokenizer.convert_tokens_to_ids(self.format.format.end_of_turn[0])

    def render(self, messages: list[Message], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt,
                                                  chat_template=self.format.template, **self.format.template_kwargs)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        """``ids`` as the text they stand for, special tokens and spacing kept."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def add_policy_turn(self, message: Message, turn_ids: list[int] | None = None, cut: bool = False) -> None:
        """Record a generated turn: ``turn_ids``, the tokens the policy generated (its stop token included when it
        stopped at one), and ``message``, the assistant message they stand for (what the template renders for it).
        ``cut``: the turn stopped at its token limit, so the next rendering closes it. Without ``turn_ids`` the
        turn is taken as the template renders ``message`` as the latest turn, up to its end of turn (what a model
        trained on that template emits: SFT data, tests)."""
        if turn_ids is None:
            text = self._rendered_turn(message)
        else:
            text = self.decode(turn_ids)
        self._turns.append(len(self.text))
        self.text += text
        self.messages.append(message)
        self.policy_turns += 1
        self._cut, self._open = cut, False

    def _rendered_turn(self, message: Message) -> str:
        """The template's rendering of ``message`` following the conversation's generation prompt, up to and
        including its first end-of-turn or stop token."""
        after = self.render(self.messages + [message], generation_prompt=False)
        before = self.render(self.messages, generation_prompt=True)
        if not after.startswith(before):  # the generation prompt is not how the template starts the turn
            return after[len(self.render(self.messages, generation_prompt=False)):]
        ends = [after.find(t, len(before)) + len(t) for t in self.format.format.all_stop_tokens
                if after.find(t, len(before)) >= 0]
        return after[len(before):min(ends) if ends else len(after)]

    def extend(self, new_messages: list[Message], generation_prompt: bool = True) -> list[int]:
        """The tokens of ``new_messages`` (and the generation prompt), to follow the trajectory's tokens.

        Raises :class:`NotAppendOnly` when the template's rendering of the conversation with ``new_messages`` does
        not begin with the text of the trajectory's tokens; the messages are then not added (:meth:`resync` adds
        them).
        """
        new_images = self._read(new_messages, len(self.messages))
        after = self.render(self.messages + new_messages, generation_prompt=generation_prompt)
        if not after.startswith(self.text):
            raise self._mismatch(after, new_messages)
        ids = self._widen(self.encode(after[len(self.text):]), new_images)
        self.messages.extend(new_messages)
        self.text, self._open, self._cut = after, generation_prompt, False
        return ids

    def resync(self, new_messages: list[Message], generation_prompt: bool = True) -> list[int]:
        """Add ``new_messages`` after a mismatch and return every token of the conversation as rendered now
        (prompt included), for a trajectory that re-tokenizes or starts a new sample."""
        new_images = self._read(new_messages, len(self.messages))
        self.messages.extend(new_messages)
        held, self.images = self.images, []  # the rendering holds them all: the images so far, then the new ones
        self.text = self.render(self.messages, generation_prompt=generation_prompt)
        self._turns, self._open, self._cut = [], generation_prompt, False
        return self._widen(self.encode(self.text), held + new_images)

    def fork(self) -> Conversation:
        """A copy whose changes leave this one as it is (a request that may be refused or cancelled)."""
        twin = copy.copy(self)
        twin.messages, twin.images, twin._turns = list(self.messages), list(self.images), list(self._turns)
        return twin

    def finish(self) -> NotAppendOnly | None:
        """The trajectory ended: None when the template's rendering of the whole conversation begins with the text
        of its tokens (what follows, such as the end of a cut last turn, is not the trajectory's), else the
        difference, as :meth:`extend` would raise it (``final``). The stop token the policy ended with may be
        missing from the rendering where nothing follows it (GLM's next role token: the message it opens never
        came)."""
        if not self.messages or self.messages[-1].get("role") != "assistant":
            return None  # ended on an observation: its rendering was held against the trajectory when it was added
        after = self.render(self.messages, generation_prompt=self._open)
        if after.startswith(self.text):
            return None
        stop = next((t for t in self.format.format.all_stop_tokens if self.text.endswith(t)), None)
        kept = self.text[:-len(stop)] if stop else None
        if kept is not None and after.startswith(kept) and not after[len(kept):].strip():
            return None
        return self._mismatch(after, [], final=True)

    def _read(self, messages: list[Message], first: int, held: list[ProcessedImage] | None = None
              ) -> list[ProcessedImage]:
        """The images of ``messages`` (the conversation's from message ``first`` on), read (``held``: as read
        already). An :class:`ImageProblem` names the message and image that cannot be read, or says that the
        model takes no images."""
        refs = image_refs(messages)
        if not refs:
            return []
        if self.encoder is None:
            where = next(first + i for i, m in enumerate(messages) if image_refs([m]))
            raise ImageProblem(f"message {where} ({messages[where - first].get('role')}) holds an image and the "
                               f"model is text-only (its config has no vision tower)")
        if held is not None and len(held) == len(refs):
            return held
        images = []
        for i, message in enumerate(messages):
            for number, ref in enumerate(image_refs([message]), 1):
                try:
                    images.append(self.encoder.load(ref))
                except ImageProblem as exc:
                    raise ImageProblem(f"message {first + i} ({message.get('role')}), image {number}: {exc}") from None
        return images

    def _widen(self, ids: list[int], images: list[ProcessedImage]) -> list[int]:
        """``ids`` (rendered) with each image span widened to its image's tokens; the images join
        :attr:`images`. A ValueError says when the template did not render one span per image."""
        if self.encoder is None:
            return ids
        try:
            widened, _ = expand_images(ids, self.encoder.spec, images)
        except ValueError as exc:
            raise ValueError(f"the chat template's rendering does not hold one image span per image part: {exc}"
                             ) from None
        self.images += images
        return widened

    def _mismatch(self, after: str, new_messages: list[Message], final: bool = False) -> NotAppendOnly:
        """The first difference between the trajectory's tokens and ``after``, the template's rendering, told by the
        message it falls in and its first differing token on each side."""
        held = self.text
        char = next((i for i, (a, b) in enumerate(zip(held, after)) if a != b), min(len(held), len(after)))
        old, new = self.encode(held), self.encode(after)
        at = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
        message = self._message_at(char)
        show = lambda ids: (repr(self.decode(ids[at:at + 1])) if at < len(ids) else "nothing")
        context = lambda text: repr(text[max(0, char - 24):char + 24])
        generated = any(start <= char for start in self._turns) and self._role(message) == "assistant"
        what = ("at the end of the trajectory, the rendering of the whole conversation differs in" if final else
                f"adding {len(new_messages)} message(s) ({', '.join(m['role'] for m in new_messages)}) after policy "
                f"turn {self.policy_turns} changed the rendering of")
        return NotAppendOnly(
            f"the chat template is not append-only for what the trajectory holds: {what} message {message} "
            f"({self._role(message)}{', as the policy generated it' if generated else ''}) at token {at}: "
            f"{show(old)} became {show(new)} ({context(held)} -> {context(after)})",
            message_index=message, token_index=at, after=after, final=final)

    def _role(self, index: int) -> str:
        return self.messages[index]["role"] if 0 <= index < len(self.messages) else "?"

    def _message_at(self, char: int) -> int:
        """The index of the message whose rendering holds character ``char`` of the conversation's rendering."""
        for i in range(1, len(self.messages) + 1):
            try:
                if len(self.render(self.messages[:i], generation_prompt=False)) > char:
                    return i - 1
            except Exception:  # a template that cannot render this prefix alone (e.g. tools without results)
                continue
        return len(self.messages) - 1
