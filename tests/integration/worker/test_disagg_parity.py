"""1 prefill + 1 decode worker give the same greedy tokens as a `both` worker and the in-process engine.

The concurrent-requests check runs on the default model, on a tiny Qwen3-MoE (`moe_cluster`) and on a
tiny DeepSeek-V2 (`mla_cluster`): the KV handoff is the same whatever the MLP, but a MoE worker must load,
prefill and decode to the same tokens, and an MLA worker hands off latent blocks instead of K/V ones.
"""

from __future__ import annotations

import pytest
from worker_client import QUESTIONS, generate, generate_many, request, wait_baseline

from engine.config import CacheConfig, EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from rpcgen.baton.v1 import worker_pb2 as pb
from tokenization.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(default_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


@pytest.fixture(scope="module")
def mixed_prompts(tokenizer) -> list[tuple[list[int], int]]:
    """16 (prompt, max_tokens): chat prompts of 30-60 tokens, two raw 3-5 token prompts (local)."""
    out = []
    for i in range(16):
        q = QUESTIONS[i % len(QUESTIONS)]
        prompt = tokenizer.encode(q)[:5] if i in (3, 11) else tokenizer.encode_chat(
            [{"role": "user", "content": f"{q} (variant {i // len(QUESTIONS)})"}])
        out.append((prompt, 16 + (i * 5) % 17))
    return out


_CLUSTERS = {"smollm2": ("cluster", "default_model_dir"), "qwen3-moe": ("moe_cluster", "moe_model_dir"),
             "deepseek-v2": ("mla_cluster", "mla_model_dir")}


@pytest.fixture(scope="module", params=list(_CLUSTERS))
def parity_model(request):  # noqa: ANN201 - (Cluster, Path), the cluster type lives in conftest
    """(cluster, model dir) of the model under test; each cluster starts on first use."""
    cluster, model_dir = _CLUSTERS[request.param]
    return request.getfixturevalue(cluster), request.getfixturevalue(model_dir)


@pytest.fixture(scope="module")
def engine_reference(parity_model, mixed_prompts) -> list[list[int]]:
    engine = LLMEngine(EngineConfig(model=str(parity_model[1]), cache=CacheConfig(num_blocks=256)))
    out: dict[str, list[int]] = {}
    for i, (p, n) in enumerate(mixed_prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        out[str(i)] = []
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    return [out[str(i)] for i in range(len(mixed_prompts))]


def test_sixteen_concurrent_requests_match_both_worker_and_engine(parity_model, mixed_prompts, engine_reference):
    cluster = parity_model[0]
    reqs = [request(p, n) for p, n in mixed_prompts]
    disagg = generate_many(cluster.decode, reqs)
    both = generate_many(cluster.both, [request(p, n) for p, n in mixed_prompts])
    assert [r.code for r in disagg + both] == [None] * 32
    assert [r.token_ids for r in disagg] == engine_reference
    assert [r.token_ids for r in both] == engine_reference
    assert [r.text for r in disagg] == [r.text for r in both]
    paths = [r.prefill_path for r in disagg]
    expected = [pb.PREFILL_PATH_LOCAL if len(p) < 8 else pb.PREFILL_PATH_REMOTE for p, _ in mixed_prompts]
    # A repeated question (i >= len(QUESTIONS)) differs from its first asking by one token near the end. If that
    # first asking has finished when the repeat is reserved, the decode worker's prefix cache holds all but a
    # few of its tokens, and prefilling locally is the policy's right answer (--min-remote-uncached-tokens);
    # whether it has finished depends on timing (the tiny MoE is fast enough that it always has).
    repeats = {i for i in range(len(QUESTIONS), len(mixed_prompts)) if len(mixed_prompts[i][0]) >= 8}
    firsts = [i for i in range(len(paths)) if i not in repeats]
    assert [paths[i] for i in firsts] == [expected[i] for i in firsts]
    assert all(paths[i] in (pb.PREFILL_PATH_LOCAL, pb.PREFILL_PATH_REMOTE) for i in repeats)
    wait_baseline([cluster.decode, cluster.prefill])
    handshakes = cluster.prefill.log_path.read_text().count("kv peer added: decode-1-")
    assert handshakes == 1  # once per peer pair, however many requests


def test_first_token_logprobs_cross_the_handoff(cluster, mixed_prompts):
    prompt, _ = mixed_prompts[0]
    remote = generate(cluster.decode, request(prompt, 3, logprobs=2))
    local = generate(cluster.both, request(prompt, 3, logprobs=2))
    assert remote.prefill_path == pb.PREFILL_PATH_REMOTE
    assert [lp.token_id for lp in remote.logprobs] == [lp.token_id for lp in local.logprobs] == local.token_ids
    for a, b in zip(remote.logprobs, local.logprobs, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t.token_id for t in a.top] == [t.token_id for t in b.top]


def test_decode_prefix_cache_skips_blocks_it_already_holds(cluster, tokenizer):
    shared = tokenizer.encode_chat([{"role": "user", "content": "Summarise the plot of Hamlet in detail, "
                                     "act by act, naming every major character and what happens to them."}])
    first = generate(cluster.decode, request(shared, 4))
    longer = shared + tokenizer.encode(" Then compare it with Macbeth, scene by scene, in a long table format.")
    second = generate(cluster.decode, request(longer, 8))
    reference = generate(cluster.both, request(longer, 8))
    assert first.prefill_path == second.prefill_path == pb.PREFILL_PATH_REMOTE
    assert second.num_cached_tokens >= 16 * (len(shared) // 16) - 16  # whole cached blocks, not sent again
    assert second.token_ids == reference.token_ids


def test_mostly_cached_prompt_prefills_locally(cluster, tokenizer):
    text = "Recite the alphabet backwards, slowly, one letter per line, and then forwards again, twice."
    prompt = tokenizer.encode_chat([{"role": "user", "content": text}])[:49]  # 3 whole blocks + 1 token
    assert len(prompt) == 49
    first = generate(cluster.decode, request(prompt, 4))
    again = generate(cluster.decode, request(prompt, 4))
    assert (first.prefill_path, again.prefill_path) == (pb.PREFILL_PATH_REMOTE, pb.PREFILL_PATH_LOCAL)
    assert again.num_cached_tokens == 48 and again.token_ids == first.token_ids
