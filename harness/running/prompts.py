"""Chat templates: turning a conversation into prompt token ids, and the template's stop rule.

`template` in a model config is either `tokenizer` (the tokenizer's own chat template: Llama-3,
Qwen2, SmolLM2 — fschat maps these wrongly or not at all) or `fschat:<name>` (e.g.
`fschat:vicuna_v1.1`, `fschat:llama-2`, as Spec-Bench builds Vicuna and LLaMA-2 prompts), or
`raw:<format>` for completion-style models (single turn; `{prompt}` is replaced by the question).
`chat_template_kwargs` in a model config go to the tokenizer's template (Qwen3's `enable_thinking: false`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from fastchat.conversation import conv_templates, get_conv_template

from methods.engine.stopping import StopCondition


@dataclass
class Message:
    role: str  # "user" | "assistant"
    content: str


class ChatTemplate:
    def __init__(self, spec: str, tokenizer, system_message: str | None = None, eos_token_ids: Sequence[int] = (),
                 template_kwargs: dict | None = None):
        """`template_kwargs`: passed to the tokenizer's chat template (`template: tokenizer`), e.g. Qwen3's
        `enable_thinking: false`."""
        self.spec = spec
        self.template_kwargs = dict(template_kwargs or {})
        self.tokenizer = tokenizer
        self.system_message = system_message
        self.stop_strings: tuple[str, ...] = ()
        eos = set(eos_token_ids)
        if tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        if spec == "tokenizer":
            if not getattr(tokenizer, "chat_template", None):
                raise ValueError("template=tokenizer, but this tokenizer has no chat template; use fschat:<name>")
        elif spec.startswith("raw:"):
            if "{prompt}" not in spec:
                raise ValueError(f"raw template needs a {{prompt}} placeholder: {spec!r}")
        elif spec.startswith("fschat:"):
            name = spec.split(":", 1)[1]
            if name not in conv_templates:
                raise ValueError(f"unknown fschat template {name!r}; valid: {', '.join(sorted(conv_templates))}")
            conv = conv_templates[name].copy()
            if conv.stop_str:
                self.stop_strings = (conv.stop_str,) if isinstance(conv.stop_str, str) else tuple(conv.stop_str)
            eos.update(conv.stop_token_ids or ())
        else:
            raise ValueError(f"unknown template {spec!r}; valid: tokenizer, fschat:<template name>, raw:<format>")
        self.eos_token_ids = frozenset(eos)

    @classmethod
    def for_model(cls, model_cfg, tokenizer) -> "ChatTemplate":
        """The template a model config (`conf/model/*.yaml`) names."""
        return cls(model_cfg.template, tokenizer, model_cfg.get("system_message"), model_cfg.get("eos_token_ids") or (),
                   dict(model_cfg.get("chat_template_kwargs") or {}))

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """Token ids of the conversation, ending where the assistant's next answer begins."""
        if self.spec == "tokenizer":
            chat = [{"role": "system", "content": self.system_message}] if self.system_message else []
            chat += [{"role": m.role, "content": m.content} for m in messages]
            return list(self.tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True,
                                                           **self.template_kwargs)["input_ids"])
        if self.spec.startswith("raw:"):
            if len(messages) != 1:
                raise ValueError(
                    f"template {self.spec!r} is single-turn; this question has {len(messages) // 2 + 1} turns"
                )
            return list(self.tokenizer(self.spec[4:].replace("{prompt}", messages[0].content)).input_ids)

        conv = get_conv_template(self.spec.split(":", 1)[1])
        if self.system_message is not None:
            conv.set_system_message(self.system_message)
        for message in messages:
            conv.append_message(conv.roles[0] if message.role == "user" else conv.roles[1], message.content)
        conv.append_message(conv.roles[1], None)
        return list(self.tokenizer(conv.get_prompt()).input_ids)

    def stop_condition(self, max_new_tokens: int) -> StopCondition:
        return StopCondition(
            max_new_tokens=max_new_tokens,
            eos_token_ids=self.eos_token_ids,
            stop_strings=self.stop_strings,
            decode=self.tokenizer.decode if self.stop_strings else None,
        )

    def answer_text(self, tokens: Sequence[int], stop: StopCondition) -> str:
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return stop.trim_text(text).strip()
