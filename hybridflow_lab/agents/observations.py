"""An observation's token ids, encoded on their own and appended after the policy's tokens (never re-encoded with
them: decode-then-encode of a whole trajectory can merge or split tokens across a turn boundary)."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from hybridflow_lab.agents.call_formats import CallFormat
from hybridflow_lab.agents.environment import Role

MARK = "\x00policy-turn\x00"  # stands for the policy's turn while the chat template renders the one after it


class ObservationRenderer:
    """With ``chat``, the tokenizer's chat template renders an observation as the ``tool`` (or ``user``) turn that
    follows the policy's turn, from the policy turn's end-of-turn tokens to the generation prompt of the next
    one; without, a tool's result is ``call_format``'s plain text and a user's message a line of its own."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, call_format: CallFormat, chat: bool) -> None:
        self.tokenizer, self.call_format, self.chat = tokenizer, call_format, chat

    def text(self, observation: str, role: Role) -> str:
        """The text the observation's tokens spell (special tokens written out)."""
        if not self.chat:
            return self.call_format.result_text(observation) if role == "tool" else f"\n{observation}\n"
        turns = [{"role": "user", "content": "."}, {"role": "assistant", "content": MARK}]
        rendered = self.tokenizer.apply_chat_template([*turns, {"role": role, "content": observation}],
                                                      tokenize=False, add_generation_prompt=True)
        if rendered.count(MARK) != 1:
            raise ValueError(f"the chat template does not render an assistant turn followed by a {role} turn "
                             "verbatim; set task.chat_template=false to use the plain observation text")
        return rendered.split(MARK, 1)[1]

    def render(self, observation: str, role: Role) -> tuple[str, list[int]]:
        """The observation's text (``text``) and its token ids, encoded on their own."""
        text = self.text(observation, role)
        return text, self.tokenizer(text, add_special_tokens=False)["input_ids"]
