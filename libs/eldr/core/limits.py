"""What shapes a service accepts, from its configuration rather than from the message.

The wire schema bounds a count matrix at 4,096 MoE layers x 65,536 experts (2^26 cells):
loose enough for any model, far too loose to allocate. A 329-byte `PrefillDone` declaring
256 x 65,536 made every router allocate dense arrays of that shape per decision and per
worker (1.1-1.3 GiB each), and a block batch of a forged geometry would fix a model's
geometry for every signature replica. So every service that densifies counts (routers,
signature replicas, the trainer) checks the geometry an event declares against
`GeometryLimits` first:

- a model listed in `models` must have exactly that geometry;
- any other model must fit the caps: at most `max_moe_layers` layers, `max_experts`
  experts and `max_cells` layers x experts (the defaults hold every open MoE model of 2025
  with room: DeepSeek-V3 58 x 256 = 14,848 cells, Qwen3-235B 94 x 128, Llama-4 24 x 128);
- with `only_listed`, a model not listed is refused outright.

Callers that know more (a router's active partition) check that too. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

DEFAULT_MAX_MOE_LAYERS = 128
DEFAULT_MAX_EXPERTS = 1024
DEFAULT_MAX_CELLS = 16_384
"""Layers x experts: a dense float64 matrix of this many cells is 128 KiB."""
DEFAULT_MAX_WORKERS = 1024
"""Default fleet size bound of a router's load table and the trainer's live workers (the
wire allows 4,096 workers per decision)."""


@dataclass(frozen=True)
class GeometryLimits:
    max_moe_layers: int = DEFAULT_MAX_MOE_LAYERS
    max_experts: int = DEFAULT_MAX_EXPERTS
    max_cells: int = DEFAULT_MAX_CELLS
    models: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    """Model name -> (MoE layers, experts) of the models served, when configured."""
    only_listed: bool = False
    """Refuse models that `models` does not list."""

    def __post_init__(self) -> None:
        if min(self.max_moe_layers, self.max_experts, self.max_cells) < 1:
            raise ValueError("geometry limits must be positive")
        for model, (n_layers, n_experts) in self.models.items():
            if n_layers < 1 or n_experts < 1:
                raise ValueError(f"model {model!r}: geometry {n_layers} x {n_experts}")

    def problem(self, model: str | None, n_layers: int, n_experts: int) -> str | None:
        """Why a message of `model` declaring `n_layers` x `n_experts` is refused, or None.
        A message that names no model (None) is held to the caps alone."""
        known = None if model is None else self.models.get(model)
        if known is not None:
            if (n_layers, n_experts) != known:
                return (
                    f"model {model!r} is configured as {known[0]} x {known[1]}, the message "
                    f"says {n_layers} x {n_experts}"
                )
            return None
        if self.only_listed and model is not None:
            return f"model {model!r} is not one of the configured models"
        if n_layers > self.max_moe_layers:
            return f"{n_layers} MoE layers, more than the {self.max_moe_layers} configured"
        if n_experts > self.max_experts:
            return f"{n_experts} experts, more than the {self.max_experts} configured"
        if n_layers * n_experts > self.max_cells:
            return (
                f"{n_layers} x {n_experts} = {n_layers * n_experts} cells, more than the "
                f"{self.max_cells} configured"
            )
        return None


def parse_model_geometries(spec: str) -> dict[str, tuple[int, int]]:
    """`"qwen3-30b-a3b=48x128,tiny-moe=4x16"` -> {model: (layers, experts)}."""
    out: dict[str, tuple[int, int]] = {}
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        model, sep, shape = item.rpartition("=")
        layers, x, experts = shape.strip().lower().partition("x")
        if not sep or not model.strip() or not x or not layers.isdigit() or not experts.isdigit():
            raise ValueError(f"expected model=LAYERSxEXPERTS, got {item!r}")
        name = model.strip()
        if name in out:
            raise ValueError(f"model {name!r} given twice")
        if int(layers) < 1 or int(experts) < 1:
            raise ValueError(f"{item!r}: layers and experts must be positive")
        out[name] = (int(layers), int(experts))
    return out
