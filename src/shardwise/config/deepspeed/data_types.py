"""DeepSpeed's data_types section: `grad_accum_dtype`, the dtype microbatches' gradients add up in. With bf16
under ZeRO-1, fp32 selects DeepSpeed's BF16_Optimizer, which adds them up in fp32 on every rank and reduces them
once a step (runtime/engine.py, `_do_optimizer_sanity_check`): shardwise's accumulate_gradients_locally. Read
after the rest of the config, whose precision and ZeRO stage decide what it means. Pure: no torch.
"""

from __future__ import annotations

from typing import Any, Mapping

from .translation import Translation, check_keys

# DeepSpeed's DtypeEnum spellings of the dtypes it accumulates in.
_DTYPES = {name: dtype for dtype, names in {
    "fp16": ("torch.float16", "fp16", "float16", "half"),
    "fp32": ("torch.float32", "fp32", "float32", "float"),
    "bf16": ("torch.bfloat16", "bf16", "bfloat16", "bfloat")}.items() for name in names}
_KEY = "data_types.grad_accum_dtype"
_FP32 = ("gradients add up in fp32: DDP's and ZeRO-1's (on their owner, reduced every microbatch), ZeRO-2/3's in "
         "their fp32 shards")


def translate_data_types(t: Translation, section: Any) -> None:
    if not isinstance(section, Mapping):
        t.problem("data_types", section, "must be a dict (DeepSpeed's section)",
                  'write e.g. "data_types": {"grad_accum_dtype": "fp32"}')
        return
    if not check_keys(t, "data_types", section, ("grad_accum_dtype",)) or section.get("grad_accum_dtype") is None:
        return
    value = section["grad_accum_dtype"]
    dtype = _DTYPES.get(str(value))
    if dtype is None:
        t.problem(_KEY, value, "is not a dtype DeepSpeed accumulates in", "use fp32, bf16 or fp16")
        return
    model = "bf16" if t.config.get("bf16") else "fp16" if t.config.get("fp16") else "fp32"
    stage = t.config.get("zero_stage", 0)
    if stage == 0 and dtype != model:
        t.problem(_KEY, value, f"differs from the model's dtype ({model}) without ZeRO, a mix DeepSpeed refuses",
                  f"use zero_optimization stage 1 (with bf16, fp32 accumulates on every rank), or {model}")
    elif stage == 1 and model == "bf16" and dtype == "fp32":
        t.set("accumulate_gradients_locally", True, _KEY)
    elif dtype == "fp32" or model == "fp32":
        t.note(_KEY, _FP32)
    else:
        t.note(_KEY, f"{_FP32}, more exact than {dtype}")
