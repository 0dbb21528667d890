"""PEFT LoRA adapter folders (``adapter_config.json`` + ``adapter_model.safetensors``) → :class:`LoraAdapter`.

PEFT stores, per adapted module, ``…layers.{l}.{self_attn|mlp}.{proj}.lora_A.weight`` [r, in] and
``lora_B.weight`` [out, r] (torch ``Linear`` layout) for the update ``scale · B·A`` of a weight [out, in],
with scale = alpha / r, or alpha / √r with ``use_rslora``; ``rank_pattern`` and ``alpha_pattern`` override
r and alpha for the modules their keys match (PEFT's rule: a key matches a module name it ends, after a
dot). Our projections are [in, out] with the same order of heads as Hugging Face's, so A and B are only
transposed. What PEFT can store but a plain LoRA update of our projections cannot express (DoRA, biases,
fully trained modules, adapters of embeddings or the LM head, other targets) is refused by name.
"""

from __future__ import annotations

import json
import math
import pathlib
import re

import numpy as np

from llm_jax.config import ModelConfig
from llm_jax.lora import TARGETS, LoraAdapter, target_dims
from llm_jax.weights.safetensors_file import SafetensorsFile

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_SCORE = re.compile(r"^(?:base_model\.model\.)?score(?:\.modules_to_save\.[\w-]+)?\.weight$")
HEAD_MODULES = {"score", "classifier"}  # PEFT's modules_to_save for SEQ_CLS: the head (ours is always "score")
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.*\.layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\."
                  r"(?P<target>\w+))\.lora_(?P<kind>[AB])(?:\.[\w-]+)?\.weight$")


def is_peft_adapter(path: str | pathlib.Path) -> bool:
    return (pathlib.Path(path) / CONFIG_FILE).is_file()


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's ``get_pattern_key``: the first pattern whose regex ends ``module`` after a dot."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _read_config(folder: pathlib.Path) -> dict:
    path = folder / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not a readable PEFT adapter config ({error})") from None
    refusals = {
        "peft_type": (config.get("peft_type", "LORA") != "LORA", f"is {config.get('peft_type')!r}; only LORA is "
                      "supported"),
        "use_dora": (bool(config.get("use_dora")), "is true: DoRA's magnitude vectors are not supported"),
        "bias": (config.get("bias", "none") != "none" or bool(config.get("lora_bias")),
                 "trains biases, which are not supported"),
        "fan_in_fan_out": (bool(config.get("fan_in_fan_out")), "is true (GPT-2's Conv1D layout), not a supported "
                           "family"),
        "modules_to_save": (bool(set(config.get("modules_to_save") or ()) - HEAD_MODULES),
                            f"lists {config.get('modules_to_save')}: fully trained modules other than a classifier's "
                            "head (score) are not supported"),
        "target_parameters": (bool(config.get("target_parameters")), "is not supported"),
    }
    for field, (bad, why) in refusals.items():
        if bad:
            raise ValueError(f"{path}: {field} {why}")
    return config


def load_peft_adapter(path: str | pathlib.Path, config: ModelConfig, name: str | None = None) -> LoraAdapter:
    """The adapter in PEFT folder ``path`` for a model of ``config`` (its shapes checked against it);
    ``name`` defaults to the folder's name."""
    folder = pathlib.Path(path)
    if not is_peft_adapter(folder):
        raise ValueError(f"{folder}: not a PEFT adapter folder (no {CONFIG_FILE})")
    peft = _read_config(folder)
    weights_path = folder / WEIGHTS_FILE
    if not weights_path.is_file():
        raise ValueError(f"{folder}: no {WEIGHTS_FILE} (adapters saved as .bin are not read: save with safetensors)")
    reader = SafetensorsFile(weights_path)
    tensors: dict[tuple[str, int], dict[str, np.ndarray]] = {}
    modules: dict[tuple[str, int], str] = {}
    score = None
    for key in sorted(reader.names()):
        if _SCORE.match(key):  # a classifier's head, trained whole (modules_to_save): [C, D] as torch stores it
            score = reader.read(key).astype(np.float32).T
            continue
        match = _KEY.match(key)
        if match is None:
            raise ValueError(f"{weights_path}: tensor {key} is not a LoRA update of a layer's projection")
        target, layer = match["target"], int(match["layer"])
        if target not in TARGETS:
            raise ValueError(f"{weights_path}: tensor {key} adapts {target}; supported targets: {list(TARGETS)}")
        if not 0 <= layer < config.n_layers:
            raise ValueError(f"{weights_path}: tensor {key} is for layer {layer}, and the model has {config.n_layers}")
        tensors.setdefault((target, layer), {})[match["kind"]] = reader.read(key).astype(np.float32)
        modules[(target, layer)] = match["module"]
    if not tensors:
        raise ValueError(f"{weights_path}: holds no LoRA tensors")
    ranks: dict[str, int] = {}
    for (target, layer), pair in tensors.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{weights_path}: {modules[(target, layer)]} has lora_{''.join(pair)} without its pair")
        In, _ = target_dims(config, target)
        a, b = pair["A"], pair["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != In or b.shape[1] != a.shape[0]:
            raise ValueError(f"{weights_path}: {modules[(target, layer)]} has lora_A {a.shape} and lora_B {b.shape}, "
                             f"expected [r, {In}] and [out, r]")
        ranks[target] = max(ranks.get(target, 0), a.shape[0])
    L, weights = config.n_layers, {}
    for target in (t for t in TARGETS if t in ranks):
        In, R = target_dims(config, target)[0], ranks[target]
        Out = next(pair["B"].shape[0] for (t, _), pair in tensors.items() if t == target)
        a_LIR, b_LRO = np.zeros((L, In, R), np.float32), np.zeros((L, R, Out), np.float32)
        for layer in range(L):
            pair = tensors.get((target, layer))
            if pair is None:
                continue
            r, module = pair["A"].shape[0], modules[(target, layer)]
            if pair["B"].shape[0] != Out:
                raise ValueError(f"{weights_path}: {module} lora_B has {pair['B'].shape[0]} outputs, other layers "
                                 f"{Out}")
            alpha = _pattern_value(peft.get("alpha_pattern") or {}, module, peft.get("lora_alpha", 8))
            scale = alpha / (math.sqrt(r) if peft.get("use_rslora") else r)
            a_LIR[layer, :, :r] = pair["A"].T
            b_LRO[layer, :r] = pair["B"].T * np.float32(scale)
        weights[target] = (a_LIR, b_LRO)
    adapter = LoraAdapter(name=name or folder.name, weights=weights, path=str(folder), score=score)
    return adapter.for_config(config)
