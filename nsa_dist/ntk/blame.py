"""One nsa-dist error naming the module, instead of a torch traceback from deep in the stack (NTK and Hessian calls)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch import nn

from nsa_dist.errors import ModelForwardError, NSAError

__all__ = ["blame"]

_local = threading.local()


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:400]


def _in_module_call(tb) -> bool:
    while tb is not None:
        if tb.tb_frame.f_code.co_name in ("_call_impl", "_wrapped_call_impl"):
            return True
        tb = tb.tb_next
    return False


@contextlib.contextmanager
def blame(model: nn.Module, what: str = "the NTK") -> Iterator[None]:
    """Run NTK / Hessian work on ``model``; an error from torch becomes one :class:`ModelForwardError`
    naming the innermost module that was running (its qualified name and type) and the cause;
    ``what`` names the measurement in it ("the NTK", "the loss Hessian").

    nsa-dist's own errors pass through unchanged (as do errors the caller handles inside the block).
    """
    if getattr(_local, "active", False):  # nested: the outermost block reports
        yield
        return
    stack: list[tuple[str, str]] = []
    me = threading.get_ident()

    def pre(name: str):
        def f(mod, args):
            if threading.get_ident() == me:
                stack.append((name, type(mod).__name__))

        return f

    def post(name: str):
        def f(mod, args, out):
            if threading.get_ident() == me:
                while stack and stack.pop()[0] != name:
                    pass

        return f

    handles = []
    for name, m in model.named_modules():
        if isinstance(m, torch.jit.ScriptModule):  # TorchScript takes no Python hooks: blame its caller
            continue
        handles.append(m.register_forward_pre_hook(pre(name)))
        handles.append(m.register_forward_hook(post(name)))
    _local.active = True
    try:
        yield
    except NSAError:
        raise
    except Exception as e:
        from nsa_dist.ntk._structured import Unproven

        if isinstance(e, Unproven):
            raise
        where = ""
        if stack and _in_module_call(e.__traceback__):
            name, kind = stack[-1]
            where = f" in module {name or '<root>'!r} ({kind})"
        raise ModelForwardError(f"computing {what} of {type(model).__name__} failed{where}: {_first_line(e)}") from e
    finally:
        _local.active = False
        for h in handles:
            h.remove()
