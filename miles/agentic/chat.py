"""Token-exact chat turns: the tokens of new messages are the suffix between two renderings of the chat
format's template, appended to the tokens the trajectory already holds.

The policy's own turns are never re-rendered into tokens: the trajectory keeps the generated ids.
The rendering of the conversation so far only says where the new messages begin: right after the token
that closed the policy's last turn in the rendered history (or, for a family whose generated stop token
opens the next message, right after that token). A template that changes what it rendered for earlier
messages up to that point when new ones arrive (not append-only) is detected and reported with the
message and the first token that differs; what follows is ``rollout.tito.on_mismatch``'s choice.

A vision-language model's messages may hold images (:mod:`miles.models.images`): the template renders each as one
image span, which the conversation widens to the image's tokens (:class:`~miles.models.vision.ImageEncoder`);
:attr:`Conversation.images` holds every image of its tokens, in order.
"""

from __future__ import annotations

from typing import Any

from miles.agentic.chat_format import BoundFormat, for_tokenizer
from miles.agentic.types import Message
from miles.models.images import ImageProblem, image_refs
from miles.models.vision import ImageEncoder, ProcessedImage, expand_images

__all__ = ["Conversation", "NotAppendOnly", "normalize_messages"]


class NotAppendOnly(ValueError):
    """The chat template rendered earlier messages differently once new ones were added.

    ``message_index``: the first message whose rendering changed; ``token_index``: the first differing
    token of the conversation's tokens; ``after``: the rendering with the new messages (for a re-render).
    """

    def __init__(self, reason: str, *, message_index: int = -1, token_index: int = -1, after: str = "") -> None:
        super().__init__(reason)
        self.message_index, self.token_index, self.after = message_index, token_index, after


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
    turn, :meth:`add_policy_turn` records the message that the generated tokens stand for (and the last
    generated token), and :meth:`extend` returns the tokens of the next messages plus the next generation
    prompt.

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
        self._last_token: int | None = None  # the last token the policy generated in its last turn
        self._cut = False  # whether that turn stopped at its token limit
        images = self._read(self.messages, 0, list(held) or None)  # before rendering: a template may not take them
        self.prompt_ids = self._widen(self.encode(self.render(self.messages, generation_prompt=True)), images)

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

    def add_policy_turn(self, message: Message, last_token_id: int | None = None, cut: bool = False) -> None:
        """Record the assistant message a generated turn stands for (its tokens stay as generated);
        ``last_token_id``: the turn's last generated token (its stop token, when it stopped at one); ``cut``: the
        turn stopped at its token limit, so the next observation starts with the end of turn it lacks."""
        self.messages.append(message)
        self.policy_turns += 1
        self._last_token = last_token_id
        self._cut = cut

    def _boundary(self, before: str, after: str) -> tuple[int, int]:
        """``(cut, start)``: the renderings must agree up to ``cut``; the new tokens start at ``start``."""
        if not self.messages or self.messages[-1].get("role") != "assistant":
            return len(before), len(before)
        fmt = self.format
        if self._cut:  # the turn's tokens end in its text: the end of turn is the observation's to add
            starts = [before.rfind(t) for t in fmt.format.end_of_turn if before.rfind(t) >= 0]
            cut = max(starts) if starts else len(before)
            return cut, cut
        if self._last_token is not None and self._last_token in fmt.next_role_ids:
            text = fmt.token_text(self._last_token)
            if after.startswith(text, len(before)):
                return len(before), len(before) + len(text)
            return len(before), len(before)  # the suffix does not open with it: compared (and reported) as is
        ends = [before.rfind(t) + len(t) for t in fmt.format.end_of_turn if before.rfind(t) >= 0]
        cut = max(ends) if ends else len(before)
        return cut, cut

    def extend(self, new_messages: list[Message], generation_prompt: bool = True) -> list[int]:
        """The tokens of ``new_messages`` (and the generation prompt), to follow the policy's last turn.

        Raises :class:`NotAppendOnly` when the template renders the conversation so far differently (up
        to the policy's end of turn) once ``new_messages`` follow it; the messages are then not added
        (:meth:`resync` adds them).
        """
        new_images = self._read(new_messages, len(self.messages))
        before = self.render(self.messages, generation_prompt=False)
        after = self.render(self.messages + new_messages, generation_prompt=generation_prompt)
        cut, start = self._boundary(before, after)
        if after[:cut] != before[:cut]:
            raise self._mismatch(before[:cut], after, new_messages)
        if (self._last_token is not None and self._last_token in self.format.next_role_ids and start == cut
                and self.messages and self.messages[-1].get("role") == "assistant"):
            raise self._mismatch(before[:cut] + self.format.token_text(self._last_token), after, new_messages)
        ids = self._widen(self.encode(after[start:]), new_images)
        self.messages.extend(new_messages)
        return ids

    def resync(self, new_messages: list[Message], generation_prompt: bool = True) -> list[int]:
        """Add ``new_messages`` after a mismatch and return every token of the conversation as rendered now
        (prompt included), for a trajectory that re-tokenizes or starts a new sample."""
        new_images = self._read(new_messages, len(self.messages))
        self.messages.extend(new_messages)
        held, self.images = self.images, []  # the rendering holds them all: the images so far, then the new ones
        return self._widen(self.encode(self.render(self.messages, generation_prompt=generation_prompt)),
                           held + new_images)

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

    def _mismatch(self, expected: str, after: str, new_messages: list[Message]) -> NotAppendOnly:
        old, new = self.encode(expected), self.encode(after)
        at = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
        char = len(self.tokenizer.decode(old[:at], skip_special_tokens=False))
        message = self._message_at(char)
        show = lambda ids: (repr(self.tokenizer.decode(ids[at:at + 1], skip_special_tokens=False)) if at < len(ids)
                            else "nothing")
        context = lambda ids: repr(self.tokenizer.decode(ids[max(0, at - 8):at + 8], skip_special_tokens=False))
        roles = ", ".join(m["role"] for m in new_messages)
        return NotAppendOnly(
            f"the chat template is not append-only after policy turn {self.policy_turns}: adding {len(new_messages)} "
            f"message(s) ({roles}) changed the rendering of message {message} ({self._role(message)}) at token {at}: "
            f"{show(old)} became {show(new)} ({context(old)} -> {context(new)})",
            message_index=message, token_index=at, after=after)

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
