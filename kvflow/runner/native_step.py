"""A step's whole decoder in one native call (kernels/csrc/decoder_step.c), for the models whose family describes
its layers for it (`native_decoder()`: layers/native_layers.py; the Llama family, Gemma 3, the mixtures of experts
and the hybrids, whose recurrent layers read and update their state slots through the step's runs) and whose every
matmul, norm and attention already runs on kvflow's kernels (the experts stacked for one call per layer:
layers/moe.py): Python embeds the tokens (scaled, on Gemma 3 and Granite), hands the step's tensors over once, and
gets the final hidden states back; the LM head and sampling stay as they are.

Why: driven layer by layer from Python, a batch-1 step of the embedded model spent about as long around its ~210
operator calls as in them (docs/performance.md, "Where a decode step's time goes"). With this step there is also
nothing left to compile: the runner starts no compile process where it is built.

`NativeDecoderStep.build` says which models it takes, and why not (logged at boot); every other model, and any
machine where the kernels cannot be built, runs the modules as before. `KVFLOW_NATIVE_STEP=0` turns it off. The
same kernels run either way (a MoE layer's router and experts too: the module path calls them as well), and the
elementwise work is computed as torch's eager ops compute it (SiLU with torch's own vector exp), so both paths give
the same bits.
"""
from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch
from torch import nn

from kvflow.kernels import build, formats, layout, ops
from kvflow.kernels.build import Experts
from kvflow.layers.moe import SparseMoE
from kvflow.kernels.recurrent import state_runs
from kvflow.layers.native_layers import (NativeDecoder, NativeGatedDeltaNet, NativeLayer, NativeMamba2, NativeShortConv,
                                         NotNative)
from kvflow.layers.norm import RMSNorm

_KV_FORMS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_ptr, _i64, _f32, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int


class _Linear(ctypes.Structure):
    _fields_ = [("codes", _ptr), ("scale", _ptr), ("minimum", _ptr), ("bias", _ptr), ("rows", _i64),
                ("width", _i64), ("bits", _int), ("flags", _int)]


class _Norm(ctypes.Structure):
    _fields_ = [("weight", _ptr), ("eps", _f32)]


class _Moe(ctypes.Structure):
    _fields_ = [("router", _ptr), ("experts", _i64), ("top_k", _i64), ("intermediate", _i64), ("gu_rows", _i64),
                ("dn_rows", _i64), ("rule", _int), ("norm_topk_prob", _int), ("gate_up", Experts), ("down", Experts)]


_MIX_ATTENTION, _MIX_SHORT_CONV, _MIX_GATED_DELTA_NET, _MIX_MAMBA2 = 0, 1, 2, 3


class _Recurrent(ctypes.Structure):
    _fields_ = [("kind", _int), ("in_ba", _Linear), ("conv_weight", _ptr), ("conv_bias", _ptr), ("channels", _i64),
                ("K", _i64), ("conv_state", _ptr), ("state", _ptr), ("A_log", _ptr), ("dt_bias", _ptr), ("D", _ptr),
                ("norm", _Norm), ("key_heads", _i64), ("value_heads", _i64), ("key_dim", _i64), ("value_dim", _i64),
                ("norm_group", _i64), ("dt_low", _f32), ("dt_high", _f32), ("out_order", _ptr)]


class _Layer(ctypes.Structure):
    _fields_ = [("input", _Norm), ("mlp_in", _Norm), ("attn_out", _Norm), ("mlp_out", _Norm), ("q", _Norm),
                ("k", _Norm), ("scale", _f32), ("window", _i64), ("cos", _ptr), ("sin_signed", _ptr),
                ("k_cache", _ptr), ("v_cache", _ptr), ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear),
                ("down", _Linear), ("qk_whole", _int), ("residual_scale", _f32), ("moe", _Moe), ("gated", _int),
                ("rec", _Recurrent)]


class _Shape(ctypes.Structure):
    _fields_ = [("layers", _i64), ("T", _i64), ("hidden", _i64), ("heads", _i64), ("kv_heads", _i64),
                ("head_dim", _i64), ("rotary_dim", _i64), ("intermediate", _i64), ("block_size", _i64),
                ("table_width", _i64), ("kv_form", _int), ("threads", _int), ("act", _int), ("positions", _ptr),
                ("slots", _ptr), ("tables", _ptr), ("row_seq", _ptr), ("final_norm", _ptr), ("final_eps", _f32),
                ("exp_vec", _ptr), ("tanh_vec", _ptr), ("exp_lanes", _int), ("runs", build.StateRuns)]


_ACTS = {"silu": 0, "gelu_pytorch_tanh": 1}


@functools.cache
def torch_vector_math() -> tuple[int | None, int | None, int]:
    """(exp address, tanh address, lanes) of the vector functions that torch's eager float32 kernels call on this
    CPU (Sleef's, from libtorch_cpu: ATen's vectors are 8 lanes under its AVX2 capability, 16 under AVX512), or
    (None, None, 0) where torch runs its scalar code or the symbols are not there: then libm's, which torch's
    kernels also use for the tails."""
    lanes = {"AVX2": 8, "AVX512": 16}.get(torch.backends.cpu.get_cpu_capability(), 0)
    if not lanes:
        return None, None, 0
    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        exp, tanh = (ctypes.cast(getattr(lib, f"Sleef_{f}f{lanes}_u10"), ctypes.c_void_p).value
                     for f in ("exp", "tanh"))
        return exp, tanh, lanes
    except (OSError, AttributeError):
        return None, None, 0


def _linear(module: nn.Module, in_features: int, bias_allowed: bool = False) -> _Linear:
    bias = getattr(module, "bias", None)
    if bias is not None and not (bias_allowed and bias.dtype == torch.float32 and bias.is_contiguous()):
        raise NotNative(f"a bias on {type(module).__name__} outside the QKV projection")
    matrix = module.native_matrix() if hasattr(module, "native_matrix") else None
    if matrix is None:
        raise NotNative(f"a {type(module).__name__} projection (not on kvflow's kernels)")
    fmt, codes, scale, minimum = matrix
    if module.in_features != in_features:
        raise NotNative("a projection of unexpected shape")
    flags = formats.linear_flags(fmt, codes, in_features, scale, minimum)
    return _Linear(codes.data_ptr(), scale.data_ptr(), minimum.data_ptr() if fmt.has_minimum else None,
                   bias.data_ptr() if bias is not None else None, module.out_features,
                   layout.padded_rows(module.out_features), fmt.bits, flags)


def _norm(module: nn.Module | None, width: int) -> _Norm:
    if module is None:
        return _Norm(None, 0.0)
    if (type(module) is not RMSNorm or not module.native or module.weight.dtype != torch.float32
            or module.weight.shape != (width,)):
        raise NotNative("a norm not on kvflow's kernel")
    return _Norm(module.weight.data_ptr(), module.eps)


def _float32(t: torch.Tensor, shape: tuple[int, ...], what: str) -> int:
    """The address of a float32, contiguous CPU tensor of this shape (a weight or a state the step reads)."""
    if t.dtype != torch.float32 or not t.is_contiguous() or not t.is_cpu or tuple(t.shape) != shape:
        raise NotNative(f"{what} that is not a float32 {list(shape)} tensor")
    return t.data_ptr()


def _mamba2(m: NativeMamba2, H: int) -> tuple[_Recurrent, _Linear, _Linear]:
    G, heads, N, P = m.groups, m.heads, m.state_size, m.head_dim
    C, K = m.conv_weight.shape
    slots, inner = m.conv_state.shape[0], heads * P
    rec = _Recurrent(kind=_MIX_MAMBA2, channels=C, K=K, conv_weight=_float32(m.conv_weight, (C, K), "a convolution"),
                     conv_bias=_float32(m.conv_bias, (C,), "a convolution bias") if m.conv_bias is not None else None,
                     conv_state=_float32(m.conv_state, (slots, K - 1, C), "a convolution state"),
                     state=_float32(m.ssm_state, (slots, heads, P, N), "an SSM state"),
                     A_log=_float32(m.A_log, (heads,), "A_log"), dt_bias=_float32(m.dt_bias, (heads,), "dt_bias"),
                     D=_float32(m.D, (heads,), "D"), norm=_Norm(_float32(m.norm_weight, (inner,), "a gated norm"),
                                                              m.norm_eps),
                     key_heads=G, value_heads=heads, key_dim=N, value_dim=P, norm_group=m.norm_group,
                     dt_low=m.time_step_limit[0], dt_high=m.time_step_limit[1])
    in_proj, out_proj = _linear(m.in_proj, H), _linear(m.out_proj, inner)
    if (C != inner + 2 * G * N or in_proj.rows != inner + C + heads or out_proj.rows != H or heads % G
            or inner % m.norm_group):
        raise NotNative("a Mamba2 layer of unexpected shapes")
    return rec, in_proj, out_proj


def _recurrent(mixer: NativeShortConv | NativeGatedDeltaNet | NativeMamba2,
               H: int) -> tuple[_Recurrent, _Linear, _Linear]:
    """A hybrid's recurrent mixer as decoder_step.c reads it, with its in and out projections (the layer's qkv and
    o), every weight and state checked to be one it reads."""
    if isinstance(mixer, NativeMamba2):
        return _mamba2(mixer, H)
    if isinstance(mixer, NativeShortConv):
        C, K = mixer.conv_weight.shape
        rec = _Recurrent(kind=_MIX_SHORT_CONV, channels=C, K=K,
                         conv_weight=_float32(mixer.conv_weight, (C, K), "a convolution"),
                         conv_state=_float32(mixer.conv_state, (mixer.conv_state.shape[0], K - 1, C),
                                             "a convolution state"))
        in_proj, out_proj = _linear(mixer.in_proj, H), _linear(mixer.out_proj, C)
        if in_proj.rows != 3 * C or out_proj.rows != H or C != H:
            raise NotNative("a short convolution of unexpected shapes")
        return rec, in_proj, out_proj
    m = mixer
    Hk, Hv, dk, dv = m.key_heads, m.value_heads, m.key_dim, m.value_dim
    C, K = m.conv_weight.shape
    slots = m.conv_state.shape[0]
    rec = _Recurrent(kind=_MIX_GATED_DELTA_NET, in_ba=_linear(m.in_ba, H), channels=C, K=K,
                     conv_weight=_float32(m.conv_weight, (C, K), "a convolution"),
                     conv_state=_float32(m.conv_state, (slots, K - 1, C), "a convolution state"),
                     state=_float32(m.recurrent_state, (slots, Hv, dk, dv), "a recurrent state"),
                     A_log=_float32(m.A_log, (Hv,), "A_log"), dt_bias=_float32(m.dt_bias, (Hv,), "dt_bias"),
                     norm=_Norm(_float32(m.norm_weight, (dv,), "a gated norm"), m.norm_eps),
                     key_heads=Hk, value_heads=Hv, key_dim=dk, value_dim=dv)
    if m.out_order is not None:
        if m.out_order.dtype != torch.int64 or not m.out_order.is_contiguous() or m.out_order.shape != (Hv * dv,):
            raise NotNative("an out_proj column order that is not int64 [value heads x dv]")
        rec.out_order = m.out_order.data_ptr()
    in_proj, out_proj = _linear(m.in_qkvz, H), _linear(m.out_proj, Hv * dv)
    if (C != 2 * Hk * dk + Hv * dv or in_proj.rows != C + Hv * dv or rec.in_ba.rows != 2 * Hv or out_proj.rows != H
            or Hv % Hk):
        raise NotNative("a Gated DeltaNet of unexpected shapes")
    return rec, in_proj, out_proj


def _moe(moe: SparseMoE, hidden: int) -> _Moe:
    """A MoE layer's router and stacked experts, as kernels/csrc/moe.c reads them (the module path's two calls)."""
    if not moe.native:
        raise NotNative("experts not stacked on kvflow's kernels")
    router = moe.gate.weight
    if router.dtype != torch.float32 or not router.is_contiguous() or router.shape != (moe.num_experts, hidden):
        raise NotNative("a router that is not float32 [experts, hidden]")
    (gu, gu_rows), (dn, dn_rows) = ops.experts_pair(
        moe.gate_up_codes, moe.gate_up_scale, moe.gate_up_minimum, moe.gate_up_bits, moe.down_codes, moe.down_scale,
        moe.down_minimum, moe.down_bits, hidden, moe.intermediate_size)
    return _Moe(router.data_ptr(), moe.num_experts, moe.top_k, moe.intermediate_size, gu_rows, dn_rows,
                moe.gate.rule, int(moe.gate.norm_topk_prob), gu, dn)


class NativeDecoderStep:
    """Holds the model's weights' and caches' addresses in decoder_step.c's structs (they live as long as the model;
    the runner builds this after the KV cache is allocated and changes neither after)."""

    def __init__(self, decoder: NativeDecoder, hidden: int, kv_dtype: torch.dtype, block_size: int):
        self.decoder = decoder
        self.lib = build.library()
        if decoder.hidden_act not in _ACTS and any(layer.gate_up is not None for layer in decoder.layers):
            raise NotNative(f"an MLP of {decoder.hidden_act}")
        layers = [self._layer(layer, hidden, kv_dtype) for layer in decoder.layers]
        attentions = [layer.attention for layer in decoder.layers if layer.attention is not None]
        # step_shape holds one dense (or shared) MLP width
        intermediates = {layer.intermediate for layer in decoder.layers if layer.gate_up is not None}
        rotated = [a for a in attentions if a.rotary is not None]          # not NoPE layers
        if (len({(a.heads, a.kv_heads, a.head_dim) for a in attentions}) > 1
                or len({a.rotary.cos.shape[1] for a in rotated}) > 1):
            raise NotNative("attention layers of different shapes or rotating different widths")
        if len(intermediates) > 1:
            raise NotNative("dense MLPs of different widths")
        mixers = [layer.recurrent for layer in decoder.layers if layer.recurrent is not None]
        self.recurrent = bool(mixers)
        self.slots = mixers[0].conv_state.shape[0] if mixers else 0     # every recurrent layer's slot count
        first = attentions[0] if attentions else None
        self.layers = (_Layer * len(layers))(*layers)
        self.shape = _Shape(layers=len(layers), hidden=hidden, heads=first.heads if first else 0,
                            kv_heads=first.kv_heads if first else 0, head_dim=first.head_dim if first else 0,
                            rotary_dim=rotated[0].rotary.cos.shape[1] if rotated else 0,
                            intermediate=max(intermediates, default=0), block_size=block_size,
                            kv_form=_KV_FORMS[kv_dtype], act=_ACTS.get(decoder.hidden_act, 0))
        final = _norm(decoder.final_norm, hidden)
        self.shape.final_norm, self.shape.final_eps = final.weight, final.eps
        self.shape.exp_vec, self.shape.tanh_vec, self.shape.exp_lanes = torch_vector_math()
        self.steps = 0          # steps run (tests and benchmarks read it)
        self.scratch = torch.empty(0)       # the step's working memory, grown to the largest step seen

    @staticmethod
    def _layer(layer: NativeLayer, H: int, kv_dtype: torch.dtype) -> _Layer:
        """One layer's description as decoder_step.c's struct, every weight checked to be one it reads."""
        attn = layer.attention
        if layer.moe is not None:
            if type(layer.moe) is not SparseMoE:
                raise NotNative(f"a {type(layer.moe).__name__} mixture of experts")
            moe = _moe(layer.moe, H)
        else:
            moe = _Moe()
        gate_up, down = _Linear(), _Linear()
        if layer.gate_up is not None:       # a dense MLP, or beside the experts a shared one (Granite 4.0 H)
            gate_up, down = _linear(layer.gate_up, H), _linear(layer.down, layer.intermediate)
            if gate_up.rows != 2 * layer.intermediate or down.rows != H:
                raise NotNative("an MLP of unexpected shapes")
        if layer.recurrent is not None:
            rec, in_proj, out_proj = _recurrent(layer.recurrent, H)
            return _Layer(input=_norm(layer.input_norm, H), mlp_in=_norm(layer.mlp_in_norm, H),
                          attn_out=_norm(layer.attn_out_norm, H), mlp_out=_norm(layer.mlp_out_norm, H),
                          qkv=in_proj, o=out_proj, gate_up=gate_up, down=down, residual_scale=layer.residual_scale,
                          moe=moe, rec=rec)
        paged, rotary = attn.paged, attn.rotary
        if paged.k_cache is None:
            raise NotNative("a layer with no KV cache")
        for cache in (paged.k_cache, paged.v_cache):
            if cache.dtype != kv_dtype or not cache.is_contiguous():
                raise NotNative("a KV cache of another element type or layout")
        for table in (rotary.cos, rotary.sin_signed) if rotary is not None else ():
            if table.dtype != torch.float32 or not table.is_contiguous():
                raise NotNative("rotary tables not float32")
        D = attn.head_dim
        q_size, kv_size = attn.heads * D, attn.kv_heads * D
        whole = attn.qk_whole
        native = _Layer(input=_norm(layer.input_norm, H), mlp_in=_norm(layer.mlp_in_norm, H),
                        attn_out=_norm(layer.attn_out_norm, H), mlp_out=_norm(layer.mlp_out_norm, H),
                        q=_norm(attn.q_norm, q_size if whole else D), k=_norm(attn.k_norm, kv_size if whole else D),
                        scale=paged.scale, window=paged.sliding_window,
                        cos=rotary.cos.data_ptr() if rotary is not None else None,
                        sin_signed=rotary.sin_signed.data_ptr() if rotary is not None else None, k_cache=paged.k_cache.data_ptr(),
                        v_cache=paged.v_cache.data_ptr(), qkv=_linear(attn.qkv, H, True), o=_linear(attn.o, q_size),
                        gate_up=gate_up, down=down, qk_whole=int(whole), residual_scale=layer.residual_scale,
                        moe=moe, gated=int(attn.output_gate))
        if attn.output_gate and whole:
            raise NotNative("a gated attention with Q/K norms over the whole projection")
        if native.qkv.rows != (2 if attn.output_gate else 1) * q_size + 2 * kv_size or native.o.rows != H:
            raise NotNative("projections of unexpected shapes")
        return native

    @classmethod
    def build(cls, model: nn.Module, *, kv_dtype: torch.dtype, block_size: int, dtype: torch.dtype,
              kernel_pool: bool, tp_size: int, lora: bool) -> tuple[NativeDecoderStep | None, str]:
        """The step for this model, or None and why not."""
        if os.environ.get("KVFLOW_NATIVE_STEP", "1") == "0":
            return None, "KVFLOW_NATIVE_STEP=0"
        if not kernel_pool or build.library() is None:
            return None, "not every matmul, norm and attention runs on kvflow's kernels here"
        if not hasattr(model, "native_decoder"):
            return None, f"{type(model).__name__} is not a decoder that it computes"
        if dtype != torch.float32 or tp_size != 1 or lora or kv_dtype not in _KV_FORMS:
            return None, "it computes float32 on one rank, without LoRA, over a float32/bf16/fp16 KV cache"
        try:
            return cls(model.native_decoder(), model.config.hidden_size, kv_dtype, block_size), ""
        except (NotNative, ValueError) as e:
            return None, str(e)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """The final hidden states [T, hidden] of the step (after the last norm), as the model's forward."""
        h = self.decoder.input_embeddings(ids).float().contiguous()
        out = torch.empty_like(h)
        T = h.shape[0]
        if T:
            tables = meta.seq_tables.contiguous()
            row_seq, slots = meta.row_seq.contiguous(), meta.slot_mapping.contiguous()
            positions = positions.contiguous()
            s = self.shape
            s.T, s.table_width, s.threads = T, tables.shape[1], ops.threads()
            s.positions, s.slots = positions.data_ptr(), slots.data_ptr()
            s.tables, s.row_seq = tables.data_ptr(), row_seq.data_ptr()
            held = ()
            if self.recurrent:          # the rows' runs over the state slots (the struct points into `held`)
                if meta.state is None:
                    raise RuntimeError("native step: a hybrid's step needs its state runs (AttentionMetadata.state)")
                s.runs, held = state_runs(meta.state, self.slots)
            need = self.lib.kvflow_decoder_step_scratch(ctypes.byref(s), self.layers, T)
            if need > self.scratch.numel():
                self.scratch = torch.empty(need, dtype=torch.float32)
            err = self.lib.kvflow_decoder_step(ctypes.byref(s), self.layers, h.data_ptr(), out.data_ptr(),
                                               self.scratch.data_ptr())
            if err == 2:
                raise ValueError("native step: a kernel refused the step's shapes (attention, experts or router)")
            if err:
                raise MemoryError("native step: a kernel ran out of memory")
        self.steps += 1
        return out
