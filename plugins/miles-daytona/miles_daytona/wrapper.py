"""One command of a Miles run as one call of Daytona's ``process/execute``, and its answer read back.

Daytona's execute endpoint pipes the text it is given into the sandbox's shell (zsh, bash or sh, the
first it finds) and answers with stdout and stderr mixed in one string, decoded as UTF-8, and with an
HTTP error on its own timeout. A Miles run needs them apart, byte-exact up to a cap, with the exit code
and whether the time limit struck. So the text sent is a small POSIX ``/bin/sh`` script (a quoted here
document, which every one of those shells passes on untouched) that:

- writes the command (base64, so no character of it can end the here document) to a temporary folder
  and runs it with ``/bin/sh -c`` in a session of its own (``setsid``), stdin closed, stdout and stderr
  to files;
- starts a watchdog that kills the command's whole process group when ``timeout_s`` has passed, and
  marks that it did;
- once the command ends, kills what it left running in its group (as Miles' local sandbox does: only
  files outlive a run) and the watchdog;
- prints a header line (a random marker, the exit code, the timed-out flag and both outputs' sizes)
  and the first ``output_bytes`` of each output in base64, so that nothing the command wrote is
  mistaken for the answer and a long output never crosses the network whole.

It needs ``mktemp``, ``base64``, ``head -c``, ``wc`` and ``sleep`` (coreutils or busybox), and
``setsid`` (util-linux or busybox) to kill a whole process tree (without it, only the command's shell
is killed).
"""

from __future__ import annotations

import base64
import binascii
import secrets
import textwrap

from miles.agentic import CUT_MARKER

__all__ = ["cut", "parse_answer", "script"]


_SCRIPT = """\
/bin/sh <<'MILES_SCRIPT'
t=$(mktemp -d) || exit 1
exec 2>/dev/null
base64 -d >"$t/c" <<'MILES_COMMAND'
@COMMAND@
MILES_COMMAND
if command -v setsid >/dev/null 2>&1; then s=setsid; else s=; fi
$s /bin/sh -c "$(cat "$t/c")" </dev/null >"$t/o" 2>"$t/e" &
p=$!
$s /bin/sh -c "sleep @TIMEOUT@; : >'$t/x'; kill -s KILL -- -$p 2>/dev/null || kill -s KILL $p" \
  </dev/null >/dev/null 2>&1 &
w=$!
wait $p
c=$?
kill -s KILL -- -$w 2>/dev/null || kill -s KILL $w 2>/dev/null
kill -s KILL -- -$p 2>/dev/null
if [ -e "$t/x" ]; then x=1; else x=0; fi
printf '\\n@MARKER@ %s %s %s %s\\n' "$c" "$x" "$(wc -c <"$t/o")" "$(wc -c <"$t/e")"
head -c @CAP@ "$t/o" | base64
printf '@MARKER@\\n'
head -c @CAP@ "$t/e" | base64
printf '@MARKER@\n'
rm -rf "$t"
MILES_SCRIPT
"""


def script(command: str, *, timeout_s: float, output_bytes: int) -> tuple[str, str]:
    """The text to send to ``process/execute`` for ``command``, and the marker its answer carries."""
    marker = f"MILES-{secrets.token_hex(8)}"
    encoded = "\n".join(textwrap.wrap(base64.b64encode(command.encode()).decode(), 76)) or "Cg=="
    text = (_SCRIPT.replace("@COMMAND@", encoded).replace("@TIMEOUT@", f"{timeout_s:.3f}")
            .replace("@CAP@", str(output_bytes)).replace("@MARKER@", marker))
    return text, marker


def parse_answer(answer: str, marker: str, output_bytes: int) -> tuple[str, str, int | None, bool]:
    """stdout, stderr (each cut to ``output_bytes`` with Miles' marker), exit code, timed out; a
    RuntimeError quoting the sandbox's answer when it is not one of :func:`script`'s."""
    _, _, rest = answer.partition(f"\n{marker} ")
    fields, _, body = rest.partition("\n")
    try:
        code, timed_out, out_size, err_size = (int(f) for f in fields.split())
        out, err = (base64.b64decode("".join(part.split())) for part in body.split(f"{marker}\n")[:2])
    except (ValueError, binascii.Error):
        raise RuntimeError(f"the sandbox did not run the command; it answered: {answer.strip()[-500:]!r}") from None
    return cut(out, out_size, output_bytes), cut(err, err_size, output_bytes), code, bool(timed_out)


def cut(data: bytes, size: int, output_bytes: int) -> str:
    """``data``, the first bytes of an output of ``size`` bytes, as text of at most ``output_bytes`` bytes
    (the cut marker included) ending with Miles' cut marker when the output was longer."""
    if size <= output_bytes:
        return data.decode(errors="replace")
    keep = max(output_bytes - len(CUT_MARKER.format(size).encode()), 0)  # room for the longest marker
    text = data[:keep].decode(errors="ignore")  # a character cut in two is left out, not replaced
    return text + CUT_MARKER.format(size - len(text.encode()))
