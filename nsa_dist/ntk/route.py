"""The resolved NTK route of one network: the forward-pass probe's result, decided once per run.

:func:`~nsa_dist.ntk.resolve_route` probes the network's forward pass (:mod:`._probe`) and returns
an :class:`NTKRoute`: the method :func:`~nsa_dist.ntk.gram` takes and, per layer, what the probe
proved — by module name, without the modules, so a run's plan carries it to every process by
value.  Handed to :func:`~nsa_dist.ntk.gram` (or the block and shard features) as ``method``, it
is bound to the network by those names and the forward pass is not probed again — while the
network's modules are in the training modes the probe saw: a Tracker's network switched between
``train()`` and ``eval()`` since (batch norm couples samples in one mode only) is probed again,
with the method first asked for, as a call without a route would.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from torch import nn

from nsa_dist.config import NTKMethod
from nsa_dist.ntk._probe import FastLayer, ForwardPlan
from nsa_dist.ntk.inputs import trainable_params

__all__ = ["LayerRoute", "NTKRoute"]


@dataclass(frozen=True)
class LayerRoute:
    """A layer the probe proved for a per-layer path (:class:`~nsa_dist.ntk._probe.FastLayer`
    without its module).

    Attributes:
        name: the module's qualified name in the measured network.
        kind: the module's class name (checked when the route is bound).
        params: names (within the module) of its trainable parameters.
        factored: Linear on 2-D inputs (structured factors) rather than formed gradients.
        clone_out: the network modifies the layer's output in place (the feature pass clones it).
    """

    name: str
    kind: str
    params: tuple[str, ...]
    factored: bool
    clone_out: bool


@dataclass(frozen=True)
class NTKRoute:
    """The NTK method of one network and the probe's per-parameter findings.

    Attributes:
        method: the concrete method (never AUTO).
        coupled: the network couples samples (its kernel is that of the whole batch).
        layers: the per-layer (fast) layers, in module order.
        generic: the parameters taken by per-sample Jacobians.
        routes: every trainable parameter → (path, reason), in parameter order.
        asked: the method asked for (AUTO, or a forced one) when the route was resolved.
        modes: each module's ``training`` flag (``model.modules()`` order) when it was probed.
    """

    method: NTKMethod
    coupled: bool
    layers: tuple[LayerRoute, ...]
    generic: tuple[str, ...]
    routes: dict[str, tuple[str, str]] = field(default_factory=dict)
    asked: NTKMethod = NTKMethod.AUTO
    modes: tuple[bool, ...] = ()

    @classmethod
    def of(cls, method: NTKMethod, plan: ForwardPlan, asked: NTKMethod, model: nn.Module) -> NTKRoute:
        """The route of a probe's ``plan`` of ``model`` with ``method`` chosen from it for ``asked``."""
        layers = tuple(
            LayerRoute(lay.name, type(lay.module).__qualname__, lay.params, lay.factored, lay.clone_out)
            for lay in plan.layers
        )
        return cls(
            NTKMethod(method), plan.coupled, layers, plan.generic, dict(plan.routes), NTKMethod(asked), modes_of(model)
        )

    def whole_batch(self, why: str) -> NTKRoute:
        """This route for points whose forward decides over their batch (``why``): the batch route."""
        reason = f"the model couples samples ({why}): the kernel of the batch forward"
        return dataclasses.replace(
            self,
            method=NTKMethod.BATCH,
            coupled=True,
            layers=(),
            generic=tuple(self.routes),
            routes={n: ("batch", reason) for n in self.routes},
        )

    def holds_for(self, model: nn.Module) -> bool:
        """Whether ``model``'s modules are in the training modes the route was probed in."""
        return modes_of(model) == self.modes

    def bind(self, model: nn.Module) -> ForwardPlan:
        """The probe's plan for ``model`` (the measured module, as :func:`~nsa_dist.ntk.inputs.prepare_model`
        returns it): its layers looked up by name — no forward pass.

        Raises:
            ValueError: ``model`` is not the network the route was resolved for (other trainable
                parameters, a layer missing or of another class).
        """
        names = tuple(trainable_params(model))
        if names != tuple(self.routes):
            raise ValueError(
                f"the NTK route was resolved for another network: its trainable parameters are "
                f"{_few(tuple(self.routes))}, this network's {_few(names)}"
            )
        layers = []
        for lay in self.layers:
            try:
                m = model.get_submodule(lay.name)
            except AttributeError:
                raise ValueError(
                    f"the NTK route was resolved for another network: it has no module {lay.name!r}"
                ) from None
            if type(m).__qualname__ != lay.kind:
                raise ValueError(
                    f"the NTK route was resolved for another network: module {lay.name!r} is a "
                    f"{type(m).__qualname__}, the route's a {lay.kind}"
                )
            layers.append(FastLayer(lay.name, m, lay.params, lay.factored, lay.clone_out))
        return ForwardPlan(self.coupled, tuple(layers), self.generic, dict(self.routes))


def modes_of(model: nn.Module) -> tuple[bool, ...]:
    """Each module's ``training`` flag, in ``model.modules()`` order."""
    return tuple(m.training for m in model.modules())


def _few(names: tuple[str, ...]) -> str:
    return ", ".join(names[:4]) + (f", … ({len(names)} in all)" if len(names) > 4 else "")
