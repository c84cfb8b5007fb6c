"""Autocast for meta tensors, which ``torch.autocast`` ignores (they carry no autocast key).

A meta probe stands for a GPU, so this follows CUDA autocast's op lists (PyTorch docs,
"Automatic Mixed Precision package", CUDA op-specific behavior): matmul-like ops cast their
floating inputs to the low precision, numerically sensitive ops cast them to float32, and
everything else runs in the widest input type. Casting happens above autograd (a
``TorchFunctionMode``), as autocast's does, so the casts and the low-precision copies that
ops save for backward appear in the graph exactly as they would on the GPU. Like autocast,
casts of parameters (leaves that require grad) are cached for the duration of a forward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from memplan.errors import MemplanError, internal_failure
from memplan.probe.meta_nested import BODY_CALLS, run_body

_T = torch.Tensor

LOWER_PRECISION = {
    F.linear, F.bilinear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d,
    F.conv_transpose2d, F.conv_transpose3d, F.prelu, F.scaled_dot_product_attention,
    torch.matmul, _T.matmul, _T.__matmul__, _T.__rmatmul__, torch.mm, _T.mm, torch.bmm, _T.bmm,
    torch.mv, _T.mv, torch.addmm, _T.addmm, torch.addbmm, _T.addbmm, torch.baddbmm,
    _T.baddbmm, torch.addmv, _T.addmv, torch.addr, _T.addr, torch.einsum,
    torch.chain_matmul, torch.linalg.multi_dot,
}  # fmt: skip

FLOAT32 = {
    F.layer_norm, F.group_norm, F.softmax, F.log_softmax, F.softmin, F.softplus,
    F.cross_entropy, F.nll_loss, F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss,
    F.kl_div, F.binary_cross_entropy_with_logits, F.cosine_similarity, F.normalize,
    F.poisson_nll_loss, F.margin_ranking_loss, F.soft_margin_loss, F.multi_margin_loss,
    F.multilabel_margin_loss, F.triplet_margin_loss, F.hinge_embedding_loss,
    F.cosine_embedding_loss,
    torch.softmax, _T.softmax, torch.log_softmax, _T.log_softmax, torch.exp, _T.exp,
    torch.expm1, _T.expm1, torch.log, _T.log, torch.log2, _T.log2, torch.log10, _T.log10,
    torch.log1p, _T.log1p, torch.reciprocal, _T.reciprocal, torch.rsqrt, _T.rsqrt,
    torch.pow, _T.pow, _T.__pow__, _T.__rpow__, torch.acos, _T.acos, torch.asin, _T.asin,
    torch.cosh, _T.cosh, torch.sinh, _T.sinh, torch.tan, _T.tan, torch.erfinv, _T.erfinv,
    torch.sum, _T.sum, torch.prod, _T.prod, torch.cumsum, _T.cumsum, torch.cumprod,
    _T.cumprod, torch.norm, _T.norm, torch.dist, torch.cdist, torch.pdist, torch.renorm,
    _T.renorm, torch.logsumexp, _T.logsumexp, torch.layer_norm, torch.group_norm,
}  # fmt: skip

_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class MetaAutocast(TorchFunctionMode):
    """``torch.autocast`` for meta tensors. ``caching`` turns the parameter-cast cache on
    (the probe enables it during forward only; recompute under checkpoint casts afresh)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.caching = False
        self._cache: dict[int, torch.Tensor] = {}

    def clear_cache(self) -> None:
        self._cache.clear()

    def _cast(self, value: Any, dtype: torch.dtype) -> Any:
        if not (
            isinstance(value, torch.Tensor) and value.dtype in _FLOATS and value.dtype != dtype
        ):
            return value
        if dtype != torch.float32 and value.dtype == torch.float64:
            return value  # autocast leaves float64 alone
        cacheable = self.caching and value.is_leaf and value.requires_grad
        if cacheable and id(value) in self._cache:
            return self._cache[id(value)]
        cast = value.to(dtype)
        if cacheable:
            self._cache[id(value)] = cast
        return cast

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if func in BODY_CALLS:  # nn.MultiheadAttention: its linears are in a Python body
            return run_body(self, func, args, kwargs)
        try:  # memplan's casts: a failure in them is memplan's own (InternalError)
            if func in LOWER_PRECISION:
                args, kwargs = tree_map(lambda v: self._cast(v, self.dtype), (args, kwargs))
            elif func in FLOAT32:
                args, kwargs = tree_map(self._to_float32, (args, kwargs))
        except MemplanError:
            raise
        except Exception as exc:
            name = getattr(func, "__name__", func)
            raise internal_failure(
                "meta autocast (probe/meta_autocast.py)", f"the casts before {name}", exc
            ) from exc
        return func(*args, **kwargs)

    def _to_float32(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dtype in (torch.float16, torch.bfloat16):
            return self._cast(value, torch.float32)
        return value
