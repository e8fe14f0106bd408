"""LoRA adapters: what a request names (LoRARequest), an adapter read from a PEFT directory
(LoRAAdapter), and the engine's set of loaded ones (LoRAAdapters).

An adapter adds scale x B @ A to some linear layers' weights. It is never merged into them:
the base weights stay shared by every request, and each step adds the low-rank term only to
the rows of the requests that use an adapter (lora_layers.py). The scale (lora_alpha / r, or
lora_alpha / sqrt(r) with rsLoRA) is folded into B once at load.

Identity: an adapter is known by its name. A request names one with the path to read it
from, so an adapter let go of (evicted past max_cpu_loras, or removed) is read again when a
request names it next; a name already loaded from another path is refused rather than
silently swapped. A loaded adapter gets a fresh `uid`, which keys its requests' cached
prefixes: two loads of one name never share KV, so a changed file is never served stale KV.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# PEFT's prefix on every tensor name: the wrapped model is base_model.model
PEFT_PREFIX = "base_model.model."
PEFT_ALPHA = 8  # PEFT's lora_alpha when the config gives none


@dataclass(frozen=True)
class LoRARequest:
    """The adapter a request runs with: vLLM's LoRARequest fields (lora_int_id is kept for its
    callers; vmkv identifies adapters by name)."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty string, got {self.lora_path!r}")
        if (
            isinstance(self.lora_int_id, bool)
            or not isinstance(self.lora_int_id, int)
            or self.lora_int_id < 1
        ):
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")


@dataclass(frozen=True)
class LoRAPair:
    """One layer's A [r, in] and scale x B [out, r], in the model's dtype and device, as two
    linear layers' weights: with the packed forms cpu_linear.py gives the model's own linears
    where it packs them (None otherwise)."""

    a: torch.Tensor
    b: torch.Tensor
    packed_a: torch.Tensor | None = None
    packed_b: torch.Tensor | None = None

    def term(self, x: torch.Tensor) -> torch.Tensor:
        """B (A x) for rows x [T, in], in their dtype."""
        if self.packed_a is None:
            return F.linear(F.linear(x, self.a), self.b)
        shrunk = torch.ops.vmkv.packed_linear.default(x, self.a, self.packed_a, None)
        return torch.ops.vmkv.packed_linear.default(shrunk, self.b, self.packed_b, None)


@dataclass(eq=False)
class LoRAAdapter:
    """A loaded adapter: for each of the model's LoRA slots (lora_layers.hook_lora_slots), its
    LoRAPair, or None where it adds nothing."""

    name: str
    path: str
    weights: list[LoRAPair | None]
    uid: str = field(default_factory=lambda: uuid.uuid4().hex)


def read_adapter(
    path: str,
    name: str,
    slots: dict[str, tuple[int, int]],
    max_rank: int,
    dtype: torch.dtype,
    device: torch.device,
    pack: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> LoRAAdapter:
    """Read a PEFT LoRA directory for a model whose LoRA slots are `slots` (module name ->
    (in_features, out_features)), its weights packed by `pack` as the model's linears are.
    Raises ValueError naming what does not fit; nothing is kept."""
    directory = Path(path).expanduser()
    config = read_adapter_config(path, name)
    tensors = _read_tensors(name, directory)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = re.fullmatch(r"(.+)\.(lora_A|lora_B)(?:\.[^.]+)?\.weight", key.removeprefix(PEFT_PREFIX))
        if match is None:
            raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA A or B weight")
        pairs.setdefault(match[1], {})[match[2]] = tensor
    weights: dict[str, LoRAPair] = {}
    for module, pair in pairs.items():
        if module not in slots:
            raise ValueError(
                f"LoRA adapter {name!r} targets {module!r}, which is not a linear layer of the model's "
                f"decoder layers"
            )
        if set(pair) != {"lora_A", "lora_B"}:
            raise ValueError(f"LoRA adapter {name!r}: {module!r} has lora_A or lora_B but not both")
        a, b = pair["lora_A"], pair["lora_B"]
        in_features, out_features = slots[module]
        r = a.shape[0] if a.dim() == 2 else 0
        if not r or a.shape != (r, in_features) or b.shape != (out_features, r):
            raise ValueError(
                f"LoRA adapter {name!r}: {module!r} has A {tuple(a.shape)} and B {tuple(b.shape)}; the "
                f"layer needs A [r, {in_features}] and B [{out_features}, r]"
            )
        if r > max_rank:
            raise ValueError(
                f"LoRA adapter {name!r} has rank {r} at {module!r}, above max_lora_rank {max_rank}"
            )
        alpha = _pattern_value(
            config.get("alpha_pattern") or {}, module, config.get("lora_alpha", PEFT_ALPHA)
        )
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
            raise ValueError(
                f"LoRA adapter {name!r}: lora_alpha for {module!r} must be a number, got {alpha!r}"
            )
        scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        a = a.to(device=device, dtype=dtype).contiguous()
        b = (b.float() * scale).to(device=device, dtype=dtype).contiguous()
        weights[module] = LoRAPair(a, b) if pack is None else LoRAPair(a, b, pack(a), pack(b))
    if not weights:
        raise ValueError(f"LoRA adapter {name!r} in {path} has no LoRA weights")
    return LoRAAdapter(name, str(directory.resolve()), [weights.get(module) for module in slots])


def read_adapter_config(path: str, name: str) -> dict:
    """The adapter's PEFT config, checked for what vmkv can run; ValueError naming the fault.
    Needs no model, so a server refuses a bad --lora-modules before it loads and compiles one."""
    config_file = Path(path).expanduser() / CONFIG_FILE
    if not config_file.is_file():
        raise ValueError(f"LoRA adapter {name!r}: no {CONFIG_FILE} in {path}")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"LoRA adapter {name!r}: {CONFIG_FILE} does not parse: {error}") from None
    _check_config(name, config)
    return config


def _check_config(name: str, config: object) -> None:
    """Refuse what vmkv would otherwise compute wrongly: other PEFT methods, DoRA, trained
    biases or whole modules, embedding adapters."""
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {name!r}: {CONFIG_FILE} is not an object")
    refusals = {
        "peft_type": (config.get("peft_type", "LORA") != "LORA", "only LoRA adapters are supported"),
        "use_dora": (bool(config.get("use_dora")), "DoRA adapters are not supported"),
        "bias": (config.get("bias", "none") != "none", "adapters that train biases are not supported"),
        "modules_to_save": (
            bool(config.get("modules_to_save")),
            "adapters that replace whole modules are not supported",
        ),
        "fan_in_fan_out": (
            bool(config.get("fan_in_fan_out")),
            "fan_in_fan_out (Conv1D) adapters are not supported",
        ),
    }
    for key, (refused, why) in refusals.items():
        if refused:
            raise ValueError(f"LoRA adapter {name!r}: {why} ({key} = {config.get(key)!r})")


def _read_tensors(name: str, directory: Path) -> dict[str, torch.Tensor]:
    for file_name in WEIGHT_FILES:
        file = directory / file_name
        if not file.is_file():
            continue
        try:
            if file.suffix == ".safetensors":
                return load_file(str(file))
            return torch.load(file, map_location="cpu", weights_only=True)
        except Exception as error:  # noqa: BLE001 - any unreadable file is the same refusal
            raise ValueError(f"LoRA adapter {name!r}: {file_name} does not load: {error}") from None
    raise ValueError(f"LoRA adapter {name!r}: no {' or '.join(WEIGHT_FILES)} in {directory}")


def _pattern_value(patterns: object, module: str, default: object) -> object:
    """PEFT's per-module override: the first pattern the module's name ends with."""
    if not isinstance(patterns, dict):
        raise ValueError(f"alpha_pattern must be an object of patterns, got {patterns!r}")
    for pattern, value in patterns.items():
        try:
            if re.fullmatch(rf"(.*\.)?{pattern}", module):
                return value
        except re.error as error:
            raise ValueError(f"alpha_pattern {pattern!r} is not a regular expression: {error}") from None
    return default


class LoRAAdapters:
    """The adapters an engine holds in memory, at most `max_loaded`, least recently used let go
    of first (a request running with one keeps its own reference)."""

    def __init__(
        self,
        slots: dict[str, tuple[int, int]],
        max_rank: int,
        max_loaded: int,
        dtype: torch.dtype,
        device: torch.device,
        pack: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.slots, self.max_rank, self.max_loaded = slots, max_rank, max_loaded
        self.dtype, self.device, self.pack = dtype, device, pack
        self._loaded: OrderedDict[str, LoRAAdapter] = OrderedDict()

    def get(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter `request` names, read from its path if it is not loaded."""
        adapter = self._loaded.get(request.lora_name)
        if adapter is None:
            adapter = self._read(request)
            self._loaded[request.lora_name] = adapter
            while len(self._loaded) > self.max_loaded:
                self._loaded.popitem(last=False)
        elif adapter.path != str(Path(request.lora_path).expanduser().resolve()):
            raise ValueError(
                f"LoRA adapter {request.lora_name!r} is loaded from {adapter.path}, not {request.lora_path}; "
                "remove it first to load another under its name"
            )
        self._loaded.move_to_end(request.lora_name)
        return adapter

    def _read(self, request: LoRARequest) -> LoRAAdapter:
        """read_adapter, any failure a ValueError: a malformed file refuses its request and
        never stops the engine."""
        try:
            return read_adapter(
                request.lora_path,
                request.lora_name,
                self.slots,
                self.max_rank,
                self.dtype,
                self.device,
                self.pack,
            )
        except ValueError:
            raise
        except Exception as error:  # noqa: BLE001 - whatever the file holds, the request is refused
            raise ValueError(
                f"LoRA adapter {request.lora_name!r} in {request.lora_path} cannot be read: "
                f"{type(error).__name__}: {error}"
            ) from None

    def remove(self, name: str) -> bool:
        """Let go of an adapter; requests running with it finish with it. Whether it was loaded."""
        return self._loaded.pop(name, None) is not None

    def names(self) -> list[str]:
        return list(self._loaded)
