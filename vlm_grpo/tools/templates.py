"""Chat templates that render tools: Qwen2-VL's and Qwen2.5-VL's shipped ones do not, so one is installed for them.

TRL's tool loop needs a template that renders the tools, the assistant's `tool_calls` and the `tool` messages (it
refuses one that does not: `supports_tool_calling`), and a response parser on the tokenizer to read the tool calls back
out of a completion (`add_response_schema` knows the shipped templates of Qwen3-VL, Qwen3.5 and others by their text).
Qwen2-VL and Qwen2.5-VL ship a template without tools, though the models were trained on Qwen2.5's tool format. When
a trainer is given tools for one of them and its processor's template cannot render them, `QWEN2_5_VL_TOOL_TEMPLATE` is
installed (logged): the shipped template unchanged without tools; with tools, Qwen2.5's format, the tools listed as
JSON in `<tools></tools>` in the system message, each call `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
tool results in a user turn as `<tool_response>\\n...\\n</tool_response>`, with their images. Its calls are parsed with
TRL's Qwen3 parser (the same `<tool_call>` JSON). Any other family whose template cannot render tools is refused here
with the fix named.
"""

from __future__ import annotations

import logging
from typing import Any

import transformers
from packaging.version import Version

from ..families import find_family

__all__ = ["QWEN2_5_VL_TOOL_TEMPLATE", "prepare_tool_template"]

logger = logging.getLogger(__name__)

# Families whose shipped template cannot render tools and which get `QWEN2_5_VL_TOOL_TEMPLATE` (byte-identical templates).
_QWEN2_VL_TYPES = ("qwen2_vl", "qwen2_5_vl")

# A message's content as Qwen2.5-VL renders it: a string, or blocks of images, videos and text.
_CONTENT = (
    "{%- if content is string %}{{- content }}{%- else %}{%- for item in content %}"
    "{%- if item.type == 'image' or 'image' in item or 'image_url' in item %}"
    "{%- set image_count.value = image_count.value + 1 %}{%- if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif -%}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif item.type == 'video' or 'video' in item %}{%- set video_count.value = video_count.value + 1 %}"
    "{%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif 'text' in item %}{{- item.text }}{%- endif %}{%- endfor %}{%- endif %}"
)
QWEN2_5_VL_TOOL_TEMPLATE = (
    "{%- set image_count = namespace(value=0) %}{%- set video_count = namespace(value=0) %}"
    "{%- macro render(content) %}" + _CONTENT + "{%- endmacro %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- render(messages[0].content) }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided "
    "with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role != 'system' %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first and tools %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- set text = render(message.content) if message.content is not none else '' %}"
    "{%- if text %}{{- '\\n' + text }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' + tool_call.name + \'", "arguments": \' }}'
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}"
    "{%- endif %}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- render(message.content) }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}{{- render(message.content) }}{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _set_response_parser(tokenizer: Any) -> None:
    """Qwen's `<tool_call>` JSON parser on `tokenizer`, as TRL's `add_response_schema` sets it for Qwen2.5 and Qwen3:
    the new-style response template where transformers reads it (5.13), else the legacy schema."""
    from trl.chat_template_utils import qwen3_schema, qwen3_template

    if Version(transformers.__version__) >= Version("5.13.0.dev0"):
        tokenizer.response_template = qwen3_template
    else:
        tokenizer.response_schema = qwen3_schema


def prepare_tool_template(processing_class: Any, model: Any, kwargs: dict[str, Any]) -> None:
    """Make `processing_class` render and parse tools when the trainer's `kwargs` give TRL `tools` or an
    `environment_factory`: a Qwen2-VL / Qwen2.5-VL processor whose template cannot render tools gets
    `QWEN2_5_VL_TOOL_TEMPLATE` and Qwen's tool-call parser (logged); another family's is refused, the fix named.
    Nothing changes without tools, or where the template already renders them (TRL then sets the parser)."""
    if not (kwargs.get("tools") or kwargs.get("environment_factory")):
        return
    from trl.chat_template_utils import supports_tool_calling

    if processing_class is None or supports_tool_calling(processing_class):
        return
    family = find_family(model)
    if family is None or family.model_type not in _QWEN2_VL_TYPES:
        name = family.model_type if family is not None else getattr(getattr(model, "config", None), "model_type", "?")
        raise ValueError(
            f"This {name} processor's chat template cannot render tools (tools, assistant tool_calls, tool messages), "
            "which TRL's tool loop needs; vlm_grpo installs one only for Qwen2-VL and Qwen2.5-VL. Set "
            "`processor.chat_template` to a template of the model's own tool format, and a parser for its calls "
            "(`processor.tokenizer.response_template`, see transformers' response parsing docs)."
        )
    processing_class.chat_template = QWEN2_5_VL_TOOL_TEMPLATE
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    if getattr(tokenizer, "chat_template", None) is not None:
        tokenizer.chat_template = QWEN2_5_VL_TOOL_TEMPLATE  # one template for both, as the checkpoint will save it
    _set_response_parser(tokenizer)
    logger.warning(
        "%s's chat template does not render tools: installed vlm_grpo's Qwen2.5-VL tool template (Qwen2.5's "
        "<tool_call> JSON format, tool results in <tool_response>; the same rendering without tools) and Qwen's "
        "tool-call parser. It is saved with the processor. See docs/tools.md.",
        family.model_type,
    )
