"""Speculative decoding with Qwen3.5's own multi-token-prediction head (`{"method": "mtp"}`: models/qwen3_5.py
`MultiTokenPredictor`, runner/mtp_drafter.py, spec_decode/mtp.py), on random-weight tiny Qwen3.5 models with an MTP
block, in float32: the block's logits against vLLM's formula written with transformers' Qwen3.5 modules (and its GGUF
twin's against the folder's); the scheduler's side (what a step carries for the drafter, lookahead blocks, drafts
kept for the request's next step only); greedy output with and without it (1 and 3 drafts; batched, chunked, from
prefix-cache hits) and against transformers; a head built to agree with the model, whose drafts are nearly all
accepted; the spec-decode metrics; a model without an MTP block refused at load."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch import nn

from kvflow import LLM, SamplingParams
from kvflow.config import EngineConfig
from kvflow.core.engine_core import EngineCore
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.scheduler import Scheduler
from kvflow.kernels.recurrent import StateBatch
from kvflow.layers.attention_metadata import AttentionMetadata, PrefillBatch
from kvflow.metrics import EngineMetrics
from kvflow.models.model_files import resolve_model_files
from kvflow.models.qwen3_5 import Qwen3_5ForCausalLM
from kvflow.request import AddRequest, Request
from kvflow.runner.step import SampledTokens
from test_hybrid_qwen3_5 import loaded as qwen3_5_loaded
from tiny_models import make_tiny_hf_model, write_gguf_from_hf
from transformers_greedy import assert_greedy_matches

TOL = 1e-4
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def mtp_config(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("qwen3_5_mtp"), family="qwen3_5", seed=3,
                              mtp_num_hidden_layers=1)


@pytest.fixture(scope="module")
def hf(mtp_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(mtp_model, dtype=torch.float32).eval()
    model.config._attn_implementation = "eager"
    return model


def rand_prompts(seed: int = 11) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 40000, (n,), generator=g).tolist() for n in (3, 21, 90, 40, 1)]


def llm(path, **engine) -> LLM:
    return LLM(str(path), dtype="float32", max_model_len=256, kv_cache_memory="64MiB", **engine)


def generate(model: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in model.generate(prompts, params)]


# ---- the block ---------------------------------------------------------------------------------------------------
def loaded(path) -> Qwen3_5ForCausalLM:
    return qwen3_5_loaded(path, mtp=True)


@torch.no_grad()
def mtp_logits(model: Qwen3_5ForCausalLM, ids: list[int], after: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kvflow: the target over `ids` (one chunk), the MTP pass over its positions (row p reads token p + 1, the last
    `after`), then one chain step at position len(ids) reading the first draft and the pass's last output. The pass's
    logits at every position and the chain step's."""
    T = len(ids)
    rows = torch.arange(T)
    empty = torch.empty(0, dtype=torch.long)
    meta = AttentionMetadata(rows, 0, prefill=PrefillBatch(1, T, T, rows, rows, rows, None),
                             state=StateBatch(torch.tensor([0, T]), torch.tensor([0]), empty, empty))
    hidden = model(torch.tensor(ids), rows, meta)
    out = model.mtp_forward(torch.tensor(ids[1:] + [after]), rows, hidden, meta)
    logits = model.compute_logits(out)
    draft = int(logits[-1].argmax())
    # the chain's step: one query at position T over the head's keys 0..T
    chain = AttentionMetadata(torch.tensor([T]), 0, prefill=PrefillBatch(
        1, 1, T + 1, torch.tensor([0]), torch.tensor([0]), torch.arange(T + 1), torch.zeros(1, 1, 1, T + 1)))
    nxt = model.mtp_forward(torch.tensor([draft]), torch.tensor([T]), out[-1:], chain)
    return logits, model.compute_logits(nxt)[0]


class ReferenceMTP(nn.Module):
    """vLLM's Qwen3_5MultiTokenPredictor.forward (vllm/model_executor/models/qwen3_5_mtp.py) with transformers'
    Qwen3.5 modules: fc over [pre_fc_norm_embedding(embed(token)); pre_fc_norm_hidden(hidden)] (that order), the
    full-attention decoder layer, then norm; logits by the model's LM head. Each call recomputes the whole sequence
    (causal attention: what an incremental pass gives)."""

    def __init__(self, hf, tensors: dict[str, torch.Tensor]):
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

        super().__init__()
        config = hf.config
        size, eps = config.hidden_size, config.rms_norm_eps
        self.hf = hf
        self.fc = nn.Linear(2 * size, size, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(size, eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(size, eps)
        self.norm = Qwen3_5RMSNorm(size, eps)
        self.layer = Qwen3_5DecoderLayer(config, config.layer_types.index("full_attention"))
        state = {n.removeprefix("mtp.").replace("layers.0.", "layer."): t for n, t in tensors.items()
                 if n.startswith("mtp.")}
        self.load_state_dict(state, strict=False)
        assert set(state) == {n for n in self.state_dict() if not n.startswith("hf.")}
        self.eval()

    @torch.no_grad()
    def forward(self, tokens: list[int], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T = len(tokens)
        embeds = self.hf.model.embed_tokens(torch.tensor(tokens))
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        positions = torch.arange(T)[None]
        cos_sin = self.hf.model.rotary_emb(x[None], positions)
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        out = self.norm(self.layer(x[None], cos_sin, attention_mask=mask, position_ids=positions)[0])
        return out, self.hf.get_output_embeddings()(out)


@torch.no_grad()
def test_the_block_computes_vllms_formula(mtp_model, hf):
    """Row p reads the target's final hidden state at p (after its final norm) and the token at p + 1; its logits
    predict the token at p + 2. The chain's next step reads the first draft and the block's own output (after its
    norm) at position p + 1."""
    from safetensors.torch import load_file

    ref = ReferenceMTP(hf, load_file(mtp_model / "model.safetensors"))
    ids = torch.randint(10, 40000, (23,), generator=torch.Generator().manual_seed(4)).tolist()
    after = 777
    got, got_next = mtp_logits(loaded(mtp_model), ids, after)
    hidden = hf.model(torch.tensor([ids])).last_hidden_state[0]
    out, want = ref(ids[1:] + [after], hidden)
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)
    draft = int(want[-1].argmax())
    _, want_next = ref(ids[1:] + [after, draft], torch.cat([hidden, out[-1:]]))
    torch.testing.assert_close(got_next, want_next[-1], rtol=TOL, atol=TOL)


def test_the_gguf_twin_holds_the_same_block(mtp_model, tmp_path):
    """llama.cpp's layout (the block after the trunk's: fc and its norms as blk.N.nextn.*, 1 + w norms, its decoder
    layer under the usual names) loads into the same block."""
    gguf_path = write_gguf_from_hf(mtp_model, tmp_path / "qwen3_5-mtp.gguf")
    assert resolve_model_files(gguf_path).config.mtp_layers == 1
    ids = torch.randint(10, 40000, (19,), generator=torch.Generator().manual_seed(6)).tolist()
    for got, want in zip(mtp_logits(loaded(gguf_path), ids, 55), mtp_logits(loaded(mtp_model), ids, 55)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ---- the scheduler's side -------------------------------------------------------------------------------------
def test_the_scheduler_sends_what_the_drafter_needs_and_keeps_its_drafts_for_the_next_step():
    kv = KVCacheManager(64, 4, enable_prefix_caching=False)
    sched = Scheduler(EngineConfig(speculative_config=mtp_config(3), max_num_batched_tokens=6), kv, max_model_len=256)
    req = Request("a", list(range(100, 110)), SamplingParams(max_tokens=20, ignore_eos=True), 20)
    sched.add_request(req)
    out = sched.schedule()                  # a chunk short of the prompt's end: the next prompt token follows it
    assert out.step.batch.next_token_ids == (106,) and out.step.batch.verified_drafts == (0,)
    assert len(kv.block_tables["a"]) == 2, "a step that samples nothing takes no lookahead blocks"
    sched.update(out, SampledTokens([], []))
    out = sched.schedule()                  # the prompt's last chunk samples: lookahead for 2 chain positions
    assert out.step.batch.next_token_ids == (-1,) and len(kv.block_tables["a"]) == 3      # positions 0..11
    assert out.step.batch.drafts_wanted == (3,)
    sched.update(out, SampledTokens([5], [None], draft_token_ids={0: (6, 7, 8)}))
    out = sched.schedule()
    (s,) = out.scheduled
    assert s.draft_token_ids == (6, 7, 8) and out.step.batch.token_ids == [5, 6, 7, 8]
    assert out.step.batch.verified_drafts == (3, 0, 0, 0) and out.step.batch.next_token_ids == (-1,) * 4
    # 6 and 7 accepted, 9 instead of 8: the drafts made at the third row (the last accepted) follow 9
    (o,) = sched.update(out, SampledTokens([6, 7, 9, 4], [None] * 4, draft_token_ids={2: (1, 2, 3), 3: (0, 0, 0)}))
    assert o.new_token_ids == [6, 7, 9]
    out = sched.schedule()
    assert out.scheduled[0].draft_token_ids == (1, 2, 3)
    # no drafts made (or made for another token count): a plain decode
    (o,) = sched.update(out, SampledTokens([1, 5, 5, 5], [None] * 4))
    assert o.new_token_ids == [1, 5] and sched.proposer.propose("a", req.token_ids, 3) == []
    out = sched.schedule()
    assert out.scheduled[0].draft_token_ids == () and out.step.batch.verified_drafts == (0,)
    sched.abort(["a"])
    assert not sched.proposer._drafts
    kv.check()


def test_drafts_are_wanted_only_where_the_next_step_could_verify_them():
    """The scheduler asks for as many drafts as a request's next step could verify (max_tokens leaves room for 1, for
    none, for 3) and none while more requests run than speculate; lookahead blocks for the chain alike."""
    for disable, wanted, blocks in ((None, (1, 0, 3), [1, 1, 2]), (2, (0, 0, 0), [1, 1, 1])):
        kv = KVCacheManager(64, 4, enable_prefix_caching=False)
        sched = Scheduler(EngineConfig(speculative_config={**mtp_config(3), "disable_by_batch_size": disable}), kv,
                          max_model_len=256)
        for rid, max_tokens in (("a", 3), ("b", 2), ("c", 20)):
            sched.add_request(Request(rid, [1, 2, 3, 4], SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                      max_tokens))
        out = sched.schedule()
        assert out.step.batch.drafts_wanted == wanted
        assert [len(kv.block_tables[r]) for r in "abc"] == blocks       # 4 prompt tokens + (wanted - 1) ahead
        sched.abort(["a", "b", "c"])
        kv.check()


# ---- the engine ------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_output_is_the_same_with_and_without_mtp(mtp_model, hf, k):
    """Batched, a 90-token prompt in chunks of 32, then again from prefix-cache hits: the tokens without MTP, and
    transformers' greedy tokens. (A random head's drafts are nearly all rejected: rolled back every step.)"""
    prompts = rand_prompts()
    plain = generate(llm(mtp_model, max_num_batched_tokens=32), prompts)
    spec = llm(mtp_model, max_num_batched_tokens=32, speculative_config=mtp_config(k))
    got = generate(spec, prompts)
    assert got == plain, "MTP speculation changed the greedy output"
    assert spec.engine.scheduler.spec_num_draft_tokens > 0
    assert generate(spec, prompts) == plain, "from prefix-cache hits"
    for p, tokens in zip(prompts, got):
        assert_greedy_matches(hf, p, tokens, f"mtp k={k}: ", MAX_TOKENS)
    spec.engine.kv_cache_manager.check()


@pytest.mark.slow
def test_a_q8_0_gguf_drafts_from_its_codes(mtp_model, tmp_path):
    """The default configuration of a Q8_0 file (its codes kept, kvflow's kernels; the MTP block's matrices too):
    the same greedy tokens with and without MTP."""
    gguf_path = write_gguf_from_hf(mtp_model, tmp_path / "qwen3_5-mtp-q8_0.gguf", ftype="q8_0")
    prompts = rand_prompts()[:3]

    def run(**spec):
        return LLM(str(gguf_path), tokenizer=str(mtp_model), max_model_len=256, kv_cache_memory="64MiB", **spec)
    plain = generate(run(), prompts)
    spec = run(speculative_config=mtp_config(2))
    assert generate(spec, prompts) == plain
    assert spec.engine.scheduler.spec_num_draft_tokens > 0
    spec.engine.kv_cache_manager.check()


@pytest.fixture(scope="module")
def agreeing_model(mtp_model, tmp_path_factory):
    """The tiny model made to draft what it will decode. Every layer's output projections (Gated DeltaNet out_proj,
    attention o_proj, MLP down_proj) are zero, so the target's hidden state at p is final_norm(embed(t[p])) and it
    picks t[p + 1] = f(t[p]) (a permuted copy of the embedding as its LM head makes f move around the vocabulary). The
    MTP block copies: fc = [I | 0] takes the normed embedding of t[p + 1] alone, its layer's projections are zero, its
    final norm is the model's, so it predicts f(t[p + 1]) = t[p + 2], as the target will."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("qwen3_5_agreeing")
    for f in mtp_model.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, folder / f.name)
    tensors = load_file(mtp_model / "model.safetensors")
    for name, t in tensors.items():
        if name.endswith(("linear_attn.out_proj.weight", "self_attn.o_proj.weight", "mlp.down_proj.weight")):
            t.zero_()
    size = tensors["mtp.fc.weight"].shape[0]
    embed = tensors["model.embed_tokens.weight"]
    tensors["lm_head.weight"] = embed[torch.randperm(len(embed), generator=torch.Generator().manual_seed(2))]
    tensors["mtp.fc.weight"] = torch.cat([torch.eye(size), torch.zeros(size, size)], dim=1)
    tensors["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(size)         # 1 + w = 1
    tensors["mtp.norm.weight"] = tensors["model.norm.weight"].clone()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_a_head_that_agrees_has_nearly_every_draft_accepted(agreeing_model):
    from transformers import AutoModelForCausalLM

    prompts = rand_prompts(seed=12)
    plain = generate(llm(agreeing_model), prompts)
    assert all(len(set(out)) > MAX_TOKENS // 2 for out in plain), "the output should wander, not repeat a token"
    spec = llm(agreeing_model, speculative_config=mtp_config(3))
    got = generate(spec, prompts)
    sched = spec.engine.scheduler
    assert got == plain
    assert sched.spec_num_accepted_tokens > 0.9 * sched.spec_num_draft_tokens > 0, (
        f"{sched.spec_num_accepted_tokens} of {sched.spec_num_draft_tokens} drafts accepted")
    # every step after a request's first speculated (each gives its accepted drafts + 1): no step went without drafts
    assert sched.spec_num_accepted_tokens + sched.spec_num_drafts == len(prompts) * (MAX_TOKENS - 1)
    hf = AutoModelForCausalLM.from_pretrained(agreeing_model, dtype=torch.float32).eval()
    for p, tokens in zip(prompts, got):
        assert_greedy_matches(hf, p, tokens, "agreeing head: ", MAX_TOKENS)
    spec.engine.kv_cache_manager.check()


def test_the_spec_decode_metrics_count_mtp_drafts(agreeing_model):
    """vLLM's spec_decode counters, from the steps' stats: drafts, draft tokens, accepted tokens, per position."""
    config = EngineConfig(model=str(agreeing_model), dtype="float32", max_model_len=256, kv_cache_memory="64MiB",
                          speculative_config=mtp_config(2))
    engine = EngineCore(config)
    metrics = EngineMetrics("tiny", max_model_len=256)
    metrics.record_cache_config(config, engine.runner.num_blocks)
    for i, p in enumerate(rand_prompts(seed=13)[:3]):
        engine.add_request(AddRequest(str(i), p, GREEDY, max_tokens=MAX_TOKENS))
    while engine.has_unfinished_requests():
        engine.step()
        metrics.record_step(engine.last_stats)
    sched = engine.scheduler
    counted = {key: ctr._value.get() for key, ctr in metrics.spec_decode.items()}
    assert counted == {"spec_num_drafts": sched.spec_num_drafts, "spec_num_draft_tokens": sched.spec_num_draft_tokens,
                       "spec_num_accepted_tokens": sched.spec_num_accepted_tokens}
    assert [c._value.get() for c in metrics.spec_decode_per_pos] == sched.spec_accepted_per_pos
    assert sched.spec_num_draft_tokens <= 2 * sched.spec_num_drafts and sched.spec_num_accepted_tokens > 0
    assert sum(sched.spec_accepted_per_pos) == sched.spec_num_accepted_tokens
    text = metrics.render().decode()
    assert f'vllm:spec_decode_num_accepted_tokens_total{{model_name="tiny"}} {float(sched.spec_num_accepted_tokens)}' \
        in text


# ---- refused ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen3_5_without_mtp(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("qwen3_5_plain"), family="qwen3_5", seed=3)


def test_a_model_without_an_mtp_block_is_refused_at_load(qwen3_5_without_mtp, tmp_path):
    llama = make_tiny_hf_model(tmp_path / "llama", family="llama")
    with pytest.raises(ValueError, match='speculative_config.method "mtp".*LlamaForCausalLM does not have'):
        llm(llama, speculative_config=mtp_config(2))
    with pytest.raises(ValueError, match='speculative_config.method "mtp".*this Qwen3.5 checkpoint has none'):
        llm(qwen3_5_without_mtp, speculative_config=mtp_config(2))
    # the config counts an MTP layer the weights do not hold
    claims = tmp_path / "claims"
    shutil.copytree(qwen3_5_without_mtp, claims)
    cfg = json.loads((claims / "config.json").read_text())
    (claims / "config.json").write_text(json.dumps({**cfg, "mtp_num_hidden_layers": 1}))
    with pytest.raises(ValueError, match='speculative_config.method "mtp".*holds none of its tensors'):
        llm(claims, speculative_config=mtp_config(1))
    assert generate(llm(claims, max_num_batched_tokens=32), [[5, 6, 7]])    # without the method it serves as before
