"""The models a gateway serves: a table of names → one `Router` (its own worker pool) each.

Several models behind one gateway are data, not branches: each served model is
a row (`ServedModel`: its names, its router, its admission), and both doors
pick the row by the request's `model` field (OpenAI `model`, gRPC
`GenerateRequest.model`), the first row when a request names none. Everything
a router owns stays within its model: its workers and their placement, the
hand-offs between them, the prefix hashes and the response cache (both keyed
by the model's fingerprint), and admission (each model's own
`max_inflight_requests`, so a flood of one model does not refuse another's
requests). Health is per model too: the gRPC health service reports each
model under its name, and the whole gateway ("" and the Generation service)
is SERVING while any model is.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from hybridgate.gateway.admission import Admission
from hybridgate.gateway.config import GatewayConfig
from hybridgate.models import model_names
from hybridgate.router import Router


class ModelNotFoundError(LookupError):
    """A request named a model this gateway does not serve (NOT_FOUND, HTTP 404 `model_not_found`)."""

    def __init__(self, name: str, served: Sequence[str]):
        super().__init__(f"The model `{name}` does not exist; this server serves {', '.join(served)}")
        self.name = name


@dataclass
class ServedModel:
    """One row: `names` the model answers to (the first is its name in answers and metrics).

    `list_aliases`: whether GET /v1/models gives each alias a card of its own, as vLLM does for every
    --served-model-name (the operator named them), or the name only (False where the aliases are the model
    file's own general.name, often with spaces, which a client's model picker would show as a second model;
    a request may still name it, and GetModelInfo still reports it)."""

    names: tuple[str, ...]
    router: Router
    admission: Admission
    list_aliases: bool = True

    @property
    def listed(self) -> tuple[str, ...]:
        """The names GET /v1/models lists a card for."""
        return self.names if self.list_aliases else self.names[:1]

    @property
    def name(self) -> str:
        return self.names[0]


class ModelTable:
    """Served models by name, the default first. `pick(name)` is the one lookup both doors make.

    Raises (constructor) ValueError when two rows share a name, or the table is empty.
    """

    def __init__(self, models: Sequence[ServedModel]):
        if not models:
            raise ValueError("--model: a gateway serves at least one model")
        self.models = list(models)
        self._by_name: dict[str, ServedModel] = {}
        for m in self.models:
            for name in m.names:
                if name in self._by_name:
                    raise ValueError(f"--model, --served-model-name: the name {name!r} is given to two models")
                self._by_name[name] = m

    @classmethod
    def single(cls, router: Router, names: Sequence[str] = (), admission: Admission | None = None,
               max_inflight_requests: int = GatewayConfig.max_inflight_requests) -> ModelTable:
        """A table of one model (the single-model gateway, or a service that embeds one router); `names`
        default to the model's own (`hybridgate.models.model_names`: its file's stem, then its general.name)."""
        return cls([ServedModel(tuple(names) or model_names(router.model), router,
                                admission or Admission(max_inflight_requests), list_aliases=bool(names))])

    @property
    def default(self) -> ServedModel:
        return self.models[0]

    @property
    def names(self) -> list[str]:
        """Every name a request may give, the default model's first."""
        return list(self._by_name)

    @property
    def listed(self) -> list[str]:
        """The names GET /v1/models lists (each row's `listed`), the default model's first."""
        return [name for m in self.models for name in m.listed]

    def pick(self, name: str | None) -> ServedModel:
        """The row of `name` (None or "": the default). Raises ModelNotFoundError naming the listed ones
        (`listed`: an implicit alias, which /v1/models hides, is accepted but not offered)."""
        if not name:
            return self.default
        try:
            return self._by_name[name]
        except KeyError:
            raise ModelNotFoundError(name, self.listed) from None

    @property
    def ready(self) -> bool:
        """Whether some model has a READY worker (the gateway as a whole serves)."""
        return any(m.router.ready for m in self.models)

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(self.models)

    def __len__(self) -> int:
        return len(self.models)
