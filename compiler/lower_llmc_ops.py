"""The lowering of llmc's fused ops (`llmc.rms_norm`, `llmc.paged_attention`, ...) to kernel launches: the
`op_<name>` handlers of compiler/lower.py's _Lowering, which dispatches each fused binding here by op name.

They read the op's arguments (passes/common.py OPS) and emit one or more launches through the lowering's
value, weight and launch helpers; each says in its launch's `fused` what it took in.
"""

from __future__ import annotations

from llmc.dtypes import DTYPES
from llmc.errors import CompileError

from .launches import View, WeightRef
from .passes.common import QUANT_ATTRS, llmc_args, prim_value
from .quant import QuantScheme
from .weights import QUANT_PARTS, linear_name


class LlmcOpLowering:
    """Mixed into _Lowering, whose helpers (view, weight, quant_index, new_value, emit, wdtype) these use."""

    def _norm(self, var, value, add_residual: bool):
        args = llmc_args(value)
        w = self.weight(args["weight"])
        x = self.view(args["x"])
        hidden = x.cols
        params = {
            "hidden": hidden,
            "eps": float(prim_value(args["eps"])),
            "wdtype": self.wdtype(w),
            "add_residual": add_residual,
        }
        y = self.new_value(hidden, x.rows)
        if add_residual:
            residual = self.view(args["residual"])
            total = self.new_value(hidden, x.rows)
            launch_args, fused = [x, residual, total, f"W[{w}]", y, x.rows, "nullptr"], ["add", "rms_norm"]
            scale = float(prim_value(args["residual_scale"]))
            if scale != 1.0:  # Granite's residual_multiplier
                params["residual_scale"] = scale
                fused.insert(0, "scale")
            if int(args["residual_weight"].ty.shape.values[0]):  # Gemma: the branch's own norm
                rw = self.weight(args["residual_weight"])
                if self.wdtype(rw) != params["wdtype"]:
                    raise CompileError("a branch norm's weight and the next norm's are packed as different dtypes")
                params["residual_norm"] = True
                launch_args[-1] = f"W[{rw}]"
                fused.insert(0, "rms_norm")
            self.emit("rmsnorm", params, launch_args, fused, [total, y])
            self.env[var] = (total, y)
        else:
            self.emit("rmsnorm", params, [x, "nullptr", "nullptr", f"W[{w}]", y, x.rows, "nullptr"], ["rms_norm"], [y])
            self.env[var] = y

    def op_rms_norm(self, var, value):
        self._norm(var, value, add_residual=False)

    def op_add_rms_norm(self, var, value):
        self._norm(var, value, add_residual=True)

    def op_add_normed(self, var, value):
        """OLMo 2's x + norm(branch): the rmsnorm kernel's add of a normed branch, with no norm of the sum."""
        args = llmc_args(value)
        x, residual = self.view(args["x"]), self.view(args["residual"])
        rw = self.weight(args["residual_weight"])
        params = {
            "hidden": x.cols,
            "eps": float(prim_value(args["eps"])),
            "wdtype": self.wdtype(rw),
            "add_residual": True,
            "residual_norm": True,
            "output_norm": False,
        }
        total = self.new_value(x.cols, x.rows)
        launch_args = [x, residual, total, "nullptr", "nullptr", x.rows, f"W[{rw}]"]
        self.emit("rmsnorm", params, launch_args, ["rms_norm", "add"], [total])
        self.env[var] = total

    def op_silu_mul(self, var, value, activation: str = "silu"):
        gate_up = self.view(llmc_args(value)["gate_up"])
        inter = gate_up.cols // 2
        out = self.new_value(inter, gate_up.rows)
        params = {"inter": inter} if activation == "silu" else {"inter": inter, "activation": activation}
        self.emit("silu_mul", params, [gate_up, out, gate_up.rows], [activation, "mul"], [out])
        self.env[var] = out

    def op_gelu_tanh_mul(self, var, value):
        self.op_silu_mul(var, value, "gelu_tanh")

    def op_softcap(self, var, value):
        """Gemma 2's final-logit soft-capping: the epilogue of the lm_head GEMM that wrote its input, so a Gemma 2
        decode step launches what Llama's does."""
        x = self.view(llmc_args(value)["x"])
        last = self.launches[-1] if self.launches else None
        if last is None or last.op not in ("gemm", "qgemm") or last.defs != [x.value] or "softcap" in last.params:
            raise CompileError(f"soft-capping {var.name} is lowered only as the epilogue of the GEMM that computes it")
        last.params["softcap"] = float(prim_value(llmc_args(value)["cap"]))
        last.fused[0] += " + softcap"
        self.env[var] = x

    def op_paged_attention(self, var, value):
        args = llmc_args(value)
        q, k, v = (self.view(args[n]) for n in ("q", "k", "v"))
        if not (q.value == k.value == v.value and q.stride == k.stride == v.stride):
            raise CompileError("paged attention needs q, k and v as column slices of one buffer (merge_qkv)")
        layer, num_heads, num_kv_heads, head_dim, window = (
            int(prim_value(args[n])) for n in ("layer", "num_heads", "num_kv_heads", "head_dim", "sliding_window")
        )
        inv_freq = [float(f) for f in args["inv_freq"].value.numpy().tolist()]
        norm_eps = float(prim_value(args["norm_eps"]))
        rotated = [] if not inv_freq else [(q, num_heads, "q_norm"), (k, num_kv_heads, "k_norm")]  # SmolLM3: NoPE
        longrope = {}
        if int(prim_value(args["original_max"])) > 0:  # Phi-3's LongRoPE: the runtime flags the long sequences
            longrope = {
                "long_inv_freq": [float(f) for f in args["long_inv_freq"].value.numpy().tolist()],
                "attention_factor": float(prim_value(args["attention_factor"])),
            }
        for view, heads, norm in rotated:
            params = {"num_heads": heads, "head_dim": head_dim, "inv_freq": inv_freq, **longrope}
            weight, fused = "nullptr", ["rope"]
            if norm_eps > 0:  # Qwen3 (each head), OLMo 2 (the whole of q or k): the RMSNorm, in the same kernel
                params["norm_eps"] = norm_eps
                w = self.weight(args[norm])
                if self.weight_list[w].shape != (head_dim,):
                    params["norm_over_heads"] = True
                weight, fused = f"W[{w}]", [f"rms_norm({norm})", "rope"]
            self.emit("rope", params, [view, str(q.stride), "positions", "T", weight], fused, [])
        out = self.new_value(num_heads * head_dim, "T")
        params = {
            "num_heads": num_heads,
            "num_kv_heads": num_kv_heads,
            "head_dim": head_dim,
            "block_size": self.block_size,
            "scale": float(prim_value(args["scale"])),
            "sliding_window": window,
            "kv_dtype": DTYPES[self.kv_dtype].short,
        }
        softcap = float(prim_value(args["softcap"]))
        if softcap > 0:  # Gemma 2
            params["softcap"] = softcap
        self.emit(
            "paged_attention",
            params,
            [
                q,
                k,
                v,
                str(q.stride),
                f"k_cache[{layer}]",
                f"v_cache[{layer}]",
                "slot_mapping",
                "query_start_loc",
                "seq_lens",
                "block_tables",
                "max_blocks",
                "B",
                "T",
                out,
            ],
            ["kv write", "attention"],
            [out],
        )
        self.env[var] = out

    def op_moe(self, var, value):
        """A mixture-of-experts MLP: moe_route (router GEMM, softmax, top-k), the experts' gate_up GEMM with its
        SwiGLU, their down GEMM (each over its tokens, gathered), moe_combine (the weighted sum)."""
        args = llmc_args(value)
        x = self.view(args["x"])
        if x.stride != x.cols:
            raise CompileError(f"mixture-of-experts {var.name}: expected a whole activation")
        experts, hidden = self.env[args["router"]].shape
        inter = self.env[args["down"]].shape[1]
        top_k = int(prim_value(args["top_k"]))
        router = self.weight(args["router"])
        route = self.new_value(2 * top_k, x.rows)
        params = {
            "experts": experts,
            "hidden": hidden,
            "top_k": top_k,
            "norm_topk": bool(prim_value(args["norm_topk"])),
            "wdtype": self.wdtype(router),
        }
        self.emit("moe_route", params, [x, f"W[{router}]", route, x.rows], ["gate", "softmax", "top_k"], [route])
        act = self.new_value(top_k * inter, x.rows)
        self._moe_gemm(args, "gate_up", x, route, act, dict(experts=experts, n=2 * inter, k=hidden, top_k=top_k))
        y = self.new_value(top_k * hidden, x.rows)
        self._moe_gemm(args, "down", act, route, y, dict(experts=experts, n=hidden, k=inter, top_k=top_k))
        out = self.new_value(hidden, x.rows)
        self.emit("moe_combine", {"hidden": hidden, "top_k": top_k}, [y, route, out, x.rows], ["weighted sum"], [out])
        self.env[var] = out

    def _moe_gemm(self, args: dict, role: str, x, route, out, params: dict) -> None:
        """The experts' stacked `role` weights over the rows each chose them for: moe_gemm, or moe_qgemm with the
        scheme quantize_linear gave them."""
        w = self.env.get(args[role])
        swiglu = role == "gate_up"
        params = {**params, "per_slot": not swiglu, "swiglu": swiglu}
        fused = [f"experts.{role}"] + (["silu", "mul"] if swiglu else [])
        quant = {a: args[f"{role}_{a}"] for a in QUANT_ATTRS}
        if int(prim_value(quant["bits"])):
            scheme, weights = self._quantized(quant, w)
            self.emit("moe_qgemm", {**params, **scheme}, [x, route, *weights, out, x.rows], fused, [out])
        else:
            i = self.weight_index(w)
            params["wdtype"] = self.wdtype(i)
            self.emit("moe_gemm", params, [x, route, f"W[{i}]", out, x.rows], fused, [out])

    # --- the quantized matmul and gather ------------------------------------------------------------

    def _quantized(self, args: dict, w: WeightRef) -> tuple[dict, list[str]]:
        """(the scheme's kernel parameters, the packed parts' args: qweight, scales, mins or nullptr)."""
        scheme = QuantScheme.of_kernel({a: int(prim_value(args[a])) for a in QUANT_ATTRS})
        quant = scheme.kernel_params()
        q, scales, *mins = (self.quant_index(w, scheme, p) for p in QUANT_PARTS if p != "mins" or scheme.stores_mins)
        return quant, [f"W[{q}]", f"W[{scales}]", f"W[{mins[0]}]" if mins else "nullptr"]

    def op_quantized_matmul(self, var, value):
        args = llmc_args(value)
        x, w = self.env.get(args["x"]), self.env.get(args["weight"])
        if not (isinstance(x, View) and x.stride == x.cols and isinstance(w, WeightRef) and len(w.shape) == 2):
            raise CompileError(f"quantized matmul {var.name}: expected a whole activation and an [N, K] weight")
        quant, weights = self._quantized(args, w)
        n, k = w.shape
        out = self.new_value(n, x.rows)
        params = {"n": n, "k": k, **quant, "has_bias": False}
        q = self.weight_specs[(w.sources, "qweight")]
        self.emit("qgemm", params, [x, *weights, "nullptr", out, x.rows], [linear_name(w.sources)], [out], weight=q)
        self.env[var] = out

    def op_quantized_take(self, var, value):
        """The embedding gather from the packed table (a tied head's qgemm reads the same parts)."""
        args = llmc_args(value)
        table = self.env.get(args["table"])
        if not (isinstance(table, WeightRef) and len(table.shape) == 2 and self.env.get(args["ids"]) == "token_ids"):
            raise CompileError(f"quantized take {var.name}: expected a [vocab, hidden] weight gathered by token ids")
        quant, weights = self._quantized(args, table)
        out = self.new_value(table.shape[1], "T")
        params = {"hidden": table.shape[1], **quant}
        self.emit("qembedding", params, ["token_ids", "T", *weights, out], ["take(embed_tokens)"], [out])
        self.env[var] = out
