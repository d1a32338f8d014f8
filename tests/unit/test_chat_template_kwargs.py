"""chat_template_kwargs reach the chat template (bloompeer/peer/api/prompts.py): Qwen3's enable_thinking
false writes the empty think block its template writes; names the API sets itself are not overridden."""

from transformers import AutoTokenizer

from bloompeer.peer.api.openai_schema import ChatMessage
from bloompeer.peer.api.prompts import chat_prompt_ids
from bloompeer.peer.cli.default_model import write_byte_tokenizer

QWEN3_END = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
             "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
             "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
             "{%- endif %}{%- endif %}")  # the end of Qwen3's template


def test_enable_thinking_reaches_the_template(tmp_path):
    write_byte_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    tokenizer.chat_template = QWEN3_END
    messages = [ChatMessage(role="user", content="Hi")]

    def prompt(kwargs):
        return tokenizer.decode(chat_prompt_ids(tokenizer, messages, template_kwargs=kwargs))

    assert prompt(None) == prompt({"enable_thinking": True}) == "<|im_start|>user\nHi<|im_end|><|im_start|>assistant\n"
    assert prompt({"enable_thinking": False}).endswith("assistant\n<think>\n\n</think>\n\n")
    assert prompt({"add_generation_prompt": False, "tokenize": True}) == prompt(None)
