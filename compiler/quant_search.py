"""The scale searches of llmc's quantizer (compiler/quant.py, compiler/kquant.py), as llama.cpp's quantizers run
them: `searched_scales` for symmetric groups (make_qx_quants: Q8_0, Q4_0, Q6_K) and `search_scale_min` for
groups with mins (make_qkx2_quants: Q4_K, Q4_1 with an imatrix). Each scores a grid of candidate roundings from
a few (weighted) sums, in torch over chunks of groups that stay in the L2 cache."""

from __future__ import annotations

import numpy as np

# make_qkx2_quants' grid: iscale = (nmax + rmin + rdelta * i) / (max - min), i = 0..nstep; (rmin, rdelta, nstep)
# as llama.cpp's Q4_K (nmax 15) and Q5_K (nmax 31) quantizers call it
QKX2_GRIDS = {15: (-1.0, 0.1, 20), 31: (-0.5, 0.1, 15)}


def search_scale_min(x: np.ndarray, weight: np.ndarray, nmax: int, chunk: int = 8192) -> tuple[np.ndarray, np.ndarray]:
    """x [..., group] -> (scale, min) [...] with min >= 0 (w = q * scale - min, q in 0..nmax) minimising the
    squared error weighted by `weight` (as x) over the roundings of make_qkx2_quants' grid (QKX2_GRIDS[nmax]). Each candidate
    rounding gets its least-squares (scale, min) and that fit's error from the same five weighted sums (as
    make_qkx2_quants scores it), so a candidate costs one rounding pass. `chunk` groups at a time, so that a
    candidate's temporaries stay in a cache instead of streaming a whole matrix from memory 22 times; each chunk
    costs about 500 small torch calls, so one of 2048 groups spent as long on those as on its arithmetic (an
    8B-shape q4_k_m compile: 46 of the search's 100 s)."""
    import torch

    shape, g = x.shape[:-1], x.shape[-1]
    xs = torch.from_numpy(np.ascontiguousarray(x, np.float32).reshape(-1, g))
    ws = torch.from_numpy(np.ascontiguousarray(weight, np.float32).reshape(-1, g))
    scale, mn = torch.empty(xs.shape[0]), torch.empty(xs.shape[0])
    for start in range(0, xs.shape[0], chunk):
        part = slice(start, start + chunk)
        scale[part], mn[part] = _search_groups(xs[part], ws[part], nmax)
    return scale.numpy().reshape(shape), mn.numpy().reshape(shape)


def _search_groups(x, w, nmax: int):
    """search_scale_min of torch x, w [groups, group]."""
    import torch

    rmin, rdelta, nstep = QKX2_GRIDS[nmax]
    lo = x.min(-1).values.clamp(max=0)
    hi = x.max(-1).values
    span = torch.where(hi > lo, hi - lo, torch.ones_like(hi))
    sw, sx, sxx = w.sum(-1), (w * x).sum(-1), (w * x * x).sum(-1)
    shifted = x - lo[:, None]
    best_scale, best_min = (hi - lo) / nmax, -lo
    best_err = torch.full_like(hi, float("inf"))
    q, wq, prod = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)
    # None: min / max round-to-nearest itself, so that no group does worse
    for r in [1 / torch.where(hi > lo, best_scale, 1)] + [(nmax + rmin + rdelta * i) / span for i in range(nstep + 1)]:
        torch.mul(r[:, None], shifted, out=q).round_().clamp_(0, nmax)
        torch.mul(w, q, out=wq)
        sl = wq.sum(-1)
        sl2 = torch.mul(wq, q, out=prod).sum(-1)
        sxl = torch.mul(wq, x, out=prod).sum(-1)
        det = sw * sl2 - sl * sl
        safe = torch.where(det > 0, det, torch.ones_like(det))
        scale = (sw * sxl - sx * sl) / safe
        low = (sl2 * sx - sl * sxl) / safe  # the fit's value at q = 0, -min
        pos = low > 0  # a min past zero: the fit through zero instead
        scale = torch.where(pos, sxl / torch.where(sl2 > 0, sl2, torch.ones_like(sl2)), scale)
        low = torch.where(pos, torch.zeros_like(low), low)
        # sum w (scale q + low - x)^2, from the sums
        err = scale * scale * sl2 + 2 * scale * low * sl + low * low * sw - 2 * scale * sxl - 2 * low * sx + sxx
        better = (det > 0) & (scale > 0) & (err < best_err)
        best_scale = torch.where(better, scale, best_scale)
        best_min = torch.where(better, -low, best_min)
        best_err = torch.where(better, err, best_err)
    return best_scale, best_min


# The searched reciprocal scales: -(qmax + 1 + SEARCH_STEP * i) / m for |i| <= SEARCH_STEPS, m the group's
# largest-magnitude value (llama.cpp's make_qx_quants grid). int8 takes every INT8_STRIDE-th point: there a step
# moves the scale by 0.08%, a fraction of a rounding step, and a Q8_0 lm_head (128256 x 4096) is the largest
# matrix a recipe searches.
SEARCH_STEPS, SEARCH_STEP, INT8_STRIDE = 9, 0.1, 3


def searched_scales(
    blocks: np.ndarray,
    lo: int,
    hi: int,
    weight: np.ndarray | None = None,
    chunk: int = 1 << 16,
    llama_cpp_grid: bool = False,
) -> np.ndarray:
    """[N, groups, g] -> each group's scale that minimises its squared error, as llama.cpp's make_qx_quants finds
    it: for each candidate rounding q = clamp(round(w * r), lo, hi) over a grid of r around -(hi + 1) / m, the
    least-squares scale sum(w q) / sum(q^2), keeping the one with the least error (the largest sum(w q)^2 /
    sum(q^2)). The grid's centre maps m to lo, so all of q's levels are in use (Q4_0's rounding); absmax / hi
    leaves one of int4's 16 unused. weight (as blocks): each element's error weighted by it (the sums become
    weighted sums). Row chunks of about `chunk` elements keep the candidates' temporaries in the L2 cache (Q6_K's
    search over a 2048-wide matrix: 1.5x faster than chunks of 256 rows). llama_cpp_grid: make_qx_quants' own
    candidates in its order (the centre, then i = -9..9), float32 as it forms them, and no other (Q6_K)."""
    import torch

    out = np.empty(blocks.shape[:2], np.float32)
    rows = max(1, chunk // (blocks.shape[1] * blocks.shape[2]))
    for start in range(0, blocks.shape[0], rows):
        b = torch.from_numpy(blocks[start : start + rows])
        a = None if weight is None else torch.from_numpy(np.ascontiguousarray(weight[start : start + rows], np.float32))
        m = torch.gather(b, 2, b.abs().argmax(dim=2, keepdim=True))[..., 0]
        m = torch.where(m == 0, torch.ones_like(m), m)
        best_fit, best = torch.zeros_like(m), torch.zeros_like(m)
        if llama_cpp_grid:
            steps = [0, *(i for i in range(-SEARCH_STEPS, SEARCH_STEPS + 1) if i)]
            grid = [-(np.float32(hi + 1) + np.float32(SEARCH_STEP) * np.float32(i)) for i in steps]
        else:  # the grid, and absmax / hi's rounding (m to hi), so that no group does worse than that
            stride = INT8_STRIDE if hi > 31 else 1
            grid = [-(hi + 1 + SEARCH_STEP * i) for i in range(-SEARCH_STEPS, SEARCH_STEPS + 1, stride)] + [hi]
        for r in grid:
            q = torch.clamp(torch.round(b * (r / m)[..., None]), lo, hi)
            aq = q if a is None else a * q
            wq, qq = (b * aq).sum(2), (q * aq).sum(2)
            qq = torch.where(qq > 0, qq, torch.ones_like(qq))
            fit = wq * wq / qq
            better = fit > best_fit
            best_fit, best = torch.where(better, fit, best_fit), torch.where(better, wq / qq, best)
        out[start : start + rows] = best.numpy()
    return out
