"""Medusa, EAGLE and EAGLE-2: loaders on released formats, exactness, tree invariants, sampling."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from methods.ar import AutoregressiveDecoder
from methods.base import BuildContext
from methods.eagle.dynamic import Eagle2Decoder
from methods.eagle.template import EagleDecoder
from methods.engine.runner import ModelRunner
from methods.engine.sampling import SamplingConfig
from methods.engine.static_trees import StaticTree
from methods.engine.stopping import StopCondition
from methods.engine.tree import Tree
from methods.medusa import MedusaDecoder
from methods.models.heads.eagle import load_eagle_head
from methods.models.heads.medusa import load_medusa_heads
from methods.models.heads.source import head_spec
from methods.models.specs import ModelSpec
from methods.settings.sizing import verify_cost
from tests.conftest import assert_embedded_greedy, decode_state, tiny_model, write_checkpoint
from tests.stats_util import PROMPT, chi_square_pvalue, draw, exact_joint

# ---------------------------------------------------------------------------------------------
# Checkpoints written by hand in the released formats


def write_medusa(folder, target, heads=5, declared=2, with_projection=True, safetensors=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden, vocab = target.config.hidden_size, target.config.vocab_size
    state = {}
    for i in range(heads):
        state[f"{i}.0.linear.weight"] = torch.randn(hidden, hidden, generator=g) * 0.1
        state[f"{i}.0.linear.bias"] = torch.randn(hidden, generator=g) * 0.1
        if with_projection:
            state[f"{i}.1.weight"] = torch.randn(vocab, hidden, generator=g) * 0.1
    folder.mkdir(parents=True, exist_ok=True)
    if safetensors:
        save_file(state, str(folder / "medusa_lm_head.safetensors"))
    else:
        torch.save({k: v.to(torch.bfloat16).float() for k, v in state.items()}, folder / "medusa_lm_head.pt")
    (folder / "config.json").write_text(json.dumps(
        {"base_model_name_or_path": "tiny", "medusa_num_heads": declared, "medusa_num_layers": 1}))
    return state


def eagle_state(target, fc_bias=True, qkv_bias=False, embed=True, seed=0, scale=0.1):
    g = torch.Generator().manual_seed(seed)
    c = target.config
    hidden, head_dim = c.hidden_size, c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    r = lambda *s: torch.randn(*s, generator=g) * scale  # noqa: E731
    state = {
        "fc.weight": r(hidden, 2 * hidden),
        "layers.0.self_attn.q_proj.weight": r(q, hidden), "layers.0.self_attn.k_proj.weight": r(kv, hidden),
        "layers.0.self_attn.v_proj.weight": r(kv, hidden), "layers.0.self_attn.o_proj.weight": r(hidden, q),
        "layers.0.mlp.gate_proj.weight": r(c.intermediate_size, hidden),
        "layers.0.mlp.up_proj.weight": r(c.intermediate_size, hidden),
        "layers.0.mlp.down_proj.weight": r(hidden, c.intermediate_size),
        "layers.0.post_attention_layernorm.weight": 1 + r(hidden),
    }
    if fc_bias:
        state["fc.bias"] = r(hidden)
    if qkv_bias:
        for name, size in (("q", q), ("k", kv), ("v", kv)):
            state[f"layers.0.self_attn.{name}_proj.bias"] = r(size)
    if embed:
        state["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().clone()
    return state


def write_eagle(folder, target, fc_bias=True, qkv_bias=False, embed=True, safetensors=False, seed=0):
    state = eagle_state(target, fc_bias, qkv_bias, embed, seed)
    c = target.config
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "bias": fc_bias,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "vocab_size": c.vocab_size, "hidden_act": "silu",
        "max_position_embeddings": 2048, "rope_theta": 10000.0, "torch_dtype": "float32",
    }
    write_checkpoint(folder, config, state, safetensors)
    return state


# ---------------------------------------------------------------------------------------------
# Independent reference computations


def reference_medusa_logits(state, hidden, head):
    h = hidden + torch.nn.functional.silu(hidden @ state[f"{head}.0.linear.weight"].T + state[f"{head}.0.linear.bias"])
    return h @ state[f"{head}.1.weight"].T


def reference_eagle_hidden(state, tokens, features, embed, heads, kv_heads, eps=1e-6, theta=10000.0):
    """EAGLE's draft layer written out: fc -> attention (RoPE, GQA, causal) -> residual ->
    post-attention RMSNorm -> SiLU MLP -> residual; no input norm."""
    x = torch.cat([embed[tokens], features], -1) @ state["fc.weight"].T + state.get("fc.bias", 0)
    n, hidden = x.shape
    head_dim = hidden // heads

    def proj(name):
        w = state[f"layers.0.self_attn.{name}_proj.weight"]
        return x @ w.T + state.get(f"layers.0.self_attn.{name}_proj.bias", 0)

    q = proj("q").view(n, heads, head_dim)
    k = proj("k").view(n, kv_heads, head_dim)
    v = proj("v").view(n, kv_heads, head_dim)
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.arange(n).float()[:, None] * inv_freq[None]
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]
    rotate = lambda t: torch.cat([-t[..., head_dim // 2:], t[..., : head_dim // 2]], -1)  # noqa: E731
    q, k = q * cos + rotate(q) * sin, k * cos + rotate(k) * sin
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(head_dim)
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    attended = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, hidden)
    h = x + attended @ state["layers.0.self_attn.o_proj.weight"].T
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * state["layers.0.post_attention_layernorm.weight"]
    mlp = (torch.nn.functional.silu(normed @ state["layers.0.mlp.gate_proj.weight"].T)
           * (normed @ state["layers.0.mlp.up_proj.weight"].T)) @ state["layers.0.mlp.down_proj.weight"].T
    return h + mlp


# ---------------------------------------------------------------------------------------------
# Loaders


@pytest.mark.parametrize("safetensors", [False, True])
def test_medusa_loader_counts_heads_from_keys(tmp_path, safetensors, caplog):
    target = tiny_model("llama", seed=30, vocab_size=64)
    state = write_medusa(tmp_path / "medusa", target, heads=5, declared=2, safetensors=safetensors)
    heads = load_medusa_heads(ModelSpec(path=str(tmp_path / "medusa")), target)
    assert len(heads) == 5 and "medusa_num_heads=2" in caplog.text
    hidden = torch.randn(3, target.config.hidden_size)
    for i in range(5):
        expected = reference_medusa_logits({k: v.float() for k, v in state.items()}, hidden, i)
        if not safetensors:  # the .pt file was written in bf16 precision
            expected = reference_medusa_logits({k: v.to(torch.bfloat16).float() for k, v in state.items()}, hidden, i)
        torch.testing.assert_close(heads[i](hidden), expected, rtol=1e-4, atol=1e-4)


def test_medusa_head_without_projection_uses_the_target_lm_head(tmp_path):
    target = tiny_model("llama", seed=31, vocab_size=64)
    state = write_medusa(tmp_path / "m", target, heads=3, declared=3, with_projection=False)
    heads = load_medusa_heads(ModelSpec(path=str(tmp_path / "m")), target)
    state = {k: v.to(torch.bfloat16).float() for k, v in state.items()}
    for i in range(3):
        state[f"{i}.1.weight"] = target.lm_head.weight
    hidden = torch.randn(2, target.config.hidden_size)
    assert heads[1][-1].weight is target.lm_head.weight  # shared, not copied
    torch.testing.assert_close(heads[1](hidden), reference_medusa_logits(state, hidden, 1), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fc_bias, qkv_bias, embed, safetensors", [
    (True, False, True, False),   # EAGLE-Vicuna style: pytorch_model.bin with fc.bias
    (False, False, True, True),   # "bias": false, model.safetensors
    (True, True, False, False),   # Qwen2-style q/k/v biases, embed_tokens left out
])
def test_eagle_loader_matches_the_reference_layer(tmp_path, fc_bias, qkv_bias, embed, safetensors):
    target = tiny_model("llama", seed=32, vocab_size=64)
    state = write_eagle(tmp_path / "e", target, fc_bias, qkv_bias, embed, safetensors)
    head = load_eagle_head(ModelSpec(path=str(tmp_path / "e")), target)
    assert (head.fc.bias is not None) == fc_bias
    if not embed:
        assert head.embed_tokens.weight is target.get_input_embeddings().weight
    tokens = torch.tensor([3, 17, 5, 9])
    features = torch.randn(4, target.config.hidden_size)
    from methods.eagle.drafter import EagleDrafter

    drafter = EagleDrafter(head, target.lm_head)
    drafter.follow(tokens.tolist(), features)
    c = target.config
    expected = reference_eagle_hidden(state, tokens, features, target.get_input_embeddings().weight,
                                      c.num_attention_heads, c.num_key_value_heads)
    torch.testing.assert_close(drafter.root_hidden, expected[-1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(drafter.root_logits, target.lm_head(expected[-1]), rtol=1e-4, atol=1e-4)


def test_eagle_loader_rejects_inconsistent_bias_and_wrong_target(tmp_path):
    target = tiny_model("llama", seed=33, vocab_size=64)
    write_eagle(tmp_path / "e", target, fc_bias=True)
    config = json.loads((tmp_path / "e" / "config.json").read_text())
    (tmp_path / "e" / "config.json").write_text(json.dumps({**config, "bias": False}))
    with pytest.raises(ValueError, match="bias=false"):
        load_eagle_head(ModelSpec(path=str(tmp_path / "e")), target)
    other = tiny_model("llama", seed=34, vocab_size=64, hidden=32)
    write_eagle(tmp_path / "f", target)
    with pytest.raises(ValueError, match="hidden_size 64, the target 32"):
        load_eagle_head(ModelSpec(path=str(tmp_path / "f")), other)


def test_random_init_heads_load_through_the_released_format_loaders(tmp_path, monkeypatch):
    monkeypatch.setenv("DECODEBENCH_CACHE", str(tmp_path))
    target = tiny_model("llama", seed=35, vocab_size=64)
    context = BuildContext(target, "tiny", {"drafts": {"eagle": {"random_init": 0}, "medusa": {"random_init": 0}}})
    eagle_folder = head_spec({}, context, "eagle").path
    medusa_folder = head_spec({}, context, "medusa").path
    assert sorted(p.name for p in (tmp_path / "heads").iterdir()) == sorted(
        [p.split("/")[-1] for p in (eagle_folder, medusa_folder)])
    assert load_eagle_head(ModelSpec(path=eagle_folder), target).fc.bias is not None
    assert len(load_medusa_heads(ModelSpec(path=medusa_folder), target)) == 4


# ---------------------------------------------------------------------------------------------
# Trees


def test_builtin_trees():
    medusa = StaticTree.build("medusa_mc_sim_7b_63")
    eagle = StaticTree.build("eagle_mc_sim_7b_63")
    per_depth = lambda t: [t.depths.count(d) for d in range(1, t.max_depth + 1)]  # noqa: E731
    assert len(medusa) == 64 and per_depth(medusa) == [10, 28, 23, 2] and medusa.top_k() == 10
    assert len(eagle) == 26 and per_depth(eagle) == [4, 8, 8, 3, 2]
    for tree in (medusa, eagle):
        anc = tree.ancestors
        for node in range(1, len(tree)):
            path = tree.paths[node - 1]
            assert tree.depths[node] == len(path)
            # ancestors of a node: the root and the nodes of every prefix of its path
            expected = {0, node} | {tree.paths.index(path[:i]) + 1 for i in range(1, len(path))}
            assert set(torch.nonzero(anc[node]).flatten().tolist()) == expected
        t = Tree(torch.zeros(len(tree), dtype=torch.long), tree.parents)
        assert len(t.paths()) == sum(1 for kids in t.children if not kids)
    with pytest.raises(ValueError, match="no parent"):
        StaticTree.build([[0], [1, 0]])
    with pytest.raises(ValueError, match="unknown tree"):
        StaticTree.build("nope")


# ---------------------------------------------------------------------------------------------
# Exactness: greedy output equals AR's


def decoders(target, tmp_path, vocab_tree_k=10, seed=0):
    write_medusa(tmp_path / f"medusa{seed}", target, heads=4, declared=4, seed=seed)
    write_eagle(tmp_path / f"eagle{seed}", target, seed=seed)
    medusa = load_medusa_heads(ModelSpec(path=str(tmp_path / f"medusa{seed}")), target)
    head = load_eagle_head(ModelSpec(path=str(tmp_path / f"eagle{seed}")), target)
    small = StaticTree.build([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]])
    return {
        "medusa": MedusaDecoder(ModelRunner(target), medusa, StaticTree.build("medusa_mc_sim_7b_63")),
        "medusa-small": MedusaDecoder(ModelRunner(target), medusa, small),
        "eagle": EagleDecoder(ModelRunner(target), head, StaticTree.build("eagle_mc_sim_7b_63")),
        "eagle2": Eagle2Decoder(ModelRunner(target), head, total_tokens=60, depth=5, top_k=vocab_tree_k),
        "eagle2-small": Eagle2Decoder(ModelRunner(target), head, total_tokens=8, depth=3, top_k=3),
        # a curve on which candidates of path probability under ~0.005 are not worth verifying
        "eagle2-adaptive": adaptive(ModelRunner(target), head, {1: 1.0, 64: 1.2}, depth=5, top_k=vocab_tree_k),
    }


def adaptive(runner: ModelRunner, head, curve: dict[int, float], decoder_class=Eagle2Decoder, **kwargs):
    """`total_tokens: adaptive` with a given verify latency curve (seconds by tokens per forward)."""
    return decoder_class(runner, head, total_tokens=64, verify_seconds=curve, **kwargs)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_greedy_tree_methods_equal_ar(arch, tmp_path):
    # a 16-token vocabulary: top-10 trees often contain the target's choice, so paths of several
    # accepted tokens are committed, not just the root
    target = tiny_model(arch, seed=40, vocab_size=16)
    ar = AutoregressiveDecoder(ModelRunner(target))
    gen = torch.Generator().manual_seed(1)
    accepted = 0
    for name, decoder in decoders(target, tmp_path).items():
        for trial in range(3):
            prompt = torch.randint(0, 16, (int(torch.randint(2, 20, (), generator=gen)),), generator=gen).tolist()
            stop = StopCondition(40)
            reference = ar.generate(prompt, stop).tokens
            out = decoder.generate(prompt, stop)
            assert out.tokens == reference, name
            assert sum(out.stats.accepted_lengths) == out.stats.new_tokens == 40
            accepted += out.stats.accepted_drafts
            assert out.stats.position_tested and out.stats.position_tested[0] >= out.stats.position_accepted[0]
    assert accepted > 50  # the commit of multi-token paths was exercised


class DuplicateSiblings(AutoregressiveDecoder):
    """Proposes trees whose siblings repeat tokens (random trees over a small vocabulary)."""

    def propose(self, state, root, budget):
        gen = self._gen
        size = int(torch.randint(2, 12, (), generator=gen))
        parents = [-1] + [int(torch.randint(0, n, (), generator=gen)) for n in range(1, size)]
        tree = Tree(torch.tensor([root] + torch.randint(0, 4, (size - 1,), generator=gen).tolist()), parents)
        if max(tree.depths) > budget:
            return Tree.root(root)
        return tree


def test_greedy_with_siblings_sharing_tokens_equals_ar():
    target = tiny_model("llama", seed=41, vocab_size=4)
    decoder = DuplicateSiblings(ModelRunner(target))
    decoder._gen = torch.Generator().manual_seed(0)
    ar = AutoregressiveDecoder(ModelRunner(target))
    shared = 0
    for prompt in ([0, 1, 2], [3, 3, 1, 0, 2], [1]):
        out = decoder.generate(prompt, StopCondition(30))
        assert out.tokens == ar.generate(prompt, StopCondition(30)).tokens
        shared += out.stats.accepted_drafts
    assert shared > 10


@pytest.mark.parametrize("method, params", [
    ("medusa", {"tree": "medusa_mc_sim_7b_63"}), ("eagle", {"tree": "eagle_mc_sim_7b_63"}),
    ("eagle2", {"total_tokens": 24, "depth": 5, "top_k": 10})])
def test_embedded_greedy_tree_methods_equal_generate(embedded, embedded_decoder, embedded_prompts, embedded_reference,
                                                     method, params):
    """Medusa's and EAGLE's published 63-node trees and a 24-node EAGLE-2 tree (the full 60 costs
    minutes more on CPU and is covered on tiny models), with the suite's trained heads for the
    embedded model."""
    assert_embedded_greedy(embedded_decoder(method, **params), embedded[1], embedded_prompts, embedded_reference)


def test_typical_acceptance_takes_the_deepest_typical_path():
    from methods.engine.acceptance import typical_accept

    tree = Tree(torch.tensor([0, 1, 2, 3, 1]), [-1, 0, 0, 1, 2])  # 0 -> {1 -> 3, 2 -> 1}
    probs = torch.tensor([
        [0.05, 0.5, 0.45, 0.0],  # after the root: tokens 1 and 2 both typical
        [0.0, 0.0, 0.0, 1.0],    # after node 1: token 3 certain
        [0.97, 0.01, 0.01, 0.01],  # after node 2: token 1 untypical
        [1.0, 0.0, 0.0, 0.0],
        [1.0, 0.0, 0.0, 0.0],
    ])
    result = typical_accept(tree, probs)
    assert result.path == [0, 1, 3] and result.next_token == 0


# ---------------------------------------------------------------------------------------------
# EAGLE-2 tree and the head's KV cache


def test_eagle2_tree_is_connected_and_bounded(tmp_path):
    target = tiny_model("llama", seed=42, vocab_size=64)
    write_eagle(tmp_path, target, seed=3)
    head = load_eagle_head(ModelSpec(path=str(tmp_path)), target)
    for total, depth, k in [(60, 5, 10), (8, 3, 4), (2, 6, 2), (100, 2, 5), (30, 0, 10)]:
        decoder = Eagle2Decoder(ModelRunner(target), head, total_tokens=total, depth=depth, top_k=k)
        decoder.target.reset()
        prefill = decoder.target.prefill([1, 2, 3, 4])
        state = decode_state(decoder, [1, 2, 3, 4], [7])
        decoder.start(state, prefill)
        tree = decoder.propose(state, 7, budget=50)
        candidates = k + depth * k * k
        assert len(tree) == min(total, 1 + candidates)
        assert max(tree.depths) <= depth + 1
        assert all(0 <= p < n for n, p in enumerate(tree.parents[1:], start=1))  # connected, topological
        # siblings under one parent are distinct tokens (top-k of one distribution)
        for kids in tree.children:
            tokens = [int(tree.tokens[c]) for c in kids]
            assert len(tokens) == len(set(tokens))


def test_eagle2_tree_built_on_the_device_is_the_tree_the_host_builds(tmp_path):
    """A fixed size builds the reranked tree on the device without a read (`DeviceTree`); the
    adaptive size's path builds it on the host from one read. Given the same candidates and size,
    both give the same tree, and the device's ancestors, earlier siblings, depths and child flags
    equal what the host derives from the parents."""
    from harness.perf.host_reads import counting_host_reads
    from methods.engine.tree import DeviceTree

    target = tiny_model("llama", seed=42, vocab_size=64)
    write_eagle(tmp_path, target, seed=3)
    head = load_eagle_head(ModelSpec(path=str(tmp_path)), target)
    for total, depth, k in [(60, 5, 10), (8, 3, 4), (2, 6, 2), (100, 2, 5), (30, 0, 10), (25, 4, 3)]:
        decoder = Eagle2Decoder(ModelRunner(target), head, total_tokens=total, depth=depth, top_k=k)
        decoder.target.reset()
        prefill = decoder.target.prefill([1, 2, 3, 4])
        state = decode_state(decoder, [1, 2, 3, 4], [7])
        decoder.start(state, prefill)
        candidates, rerank = [], decoder.rerank
        decoder.rerank = lambda *args: candidates.append(args) or rerank(*args)
        with counting_host_reads() as reads:
            tree = decoder.propose(state, 7, budget=50)
            tree.ancestors, tree.earlier_siblings, tree.has_children  # what verifying and accepting it build
        assert isinstance(tree, DeviceTree) and reads.total == 0, reads.counts
        decoder.verify_seconds = {1: 1.0}
        decoder.adaptive_size = lambda probabilities, greedy, batch=1: len(probabilities)
        host = rerank(*candidates[0])
        assert not isinstance(host, DeviceTree)
        assert torch.equal(tree.tokens, host.tokens) and tree.parents == host.parents
        assert tree.node_depths.tolist() == host.depths
        assert torch.equal(tree.ancestors, host.ancestors) and torch.equal(tree.earlier_siblings, host.earlier_siblings)
        assert tree.has_children.tolist() == [bool(kids) for kids in host.children]


@pytest.mark.parametrize("method", ["eagle", "eagle2"])
def test_head_cache_after_commit_equals_cache_built_along_the_accepted_path(tmp_path, method):
    target = tiny_model("llama", seed=45, vocab_size=16)
    decoder = decoders(target, tmp_path)[method]
    prompt = [1, 5, 2, 7, 3]
    out = decoder.generate(prompt, StopCondition(25))
    assert out.stats.accepted_drafts > 0
    # rebuild: target features of the whole sequence, then the pairs (x_{i+1}, f_i) in one go
    sequence = prompt + out.tokens
    runner = ModelRunner(target)
    features = runner.prefill(sequence[:-1]).hidden
    from methods.eagle.drafter import EagleDrafter

    fresh = EagleDrafter(decoder.drafter.head, target.lm_head)
    fresh.follow(sequence[1:], features)
    # the decoder's drafter stopped with the last step's pairs committed (tree entries dropped)
    assert_committed_cache_equals(decoder.drafter, fresh, len(prompt), len(sequence))


def assert_committed_cache_equals(live, fresh, prompt_length: int, sequence_length: int) -> None:
    """The head cache a decoder's drafter committed equals the one built along the accepted
    sequence from scratch (the tree entries of its last step dropped)."""
    live.cache.rollback(live.committed)
    n = live.committed
    assert prompt_length < n <= sequence_length - 1
    for mine, ref in zip(live.cache.layers, fresh.cache.layers):
        torch.testing.assert_close(mine.keys, ref.keys[..., :n, :], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(mine.values, ref.values[..., :n, :], rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Sampling preserves the target distribution


@pytest.fixture(scope="module")
def tiny_vocab_target(tiny_vocab_pair):
    return tiny_vocab_pair[0]


def tiny_tree_decoders(target, folder):
    write_eagle(folder, target, seed=5)
    head = load_eagle_head(ModelSpec(path=str(folder)), target)
    tree = StaticTree.build([[0], [1], [2], [0, 0], [0, 1], [1, 0]])
    return {
        "eagle": EagleDecoder(ModelRunner(target), head, tree),
        "eagle2": Eagle2Decoder(ModelRunner(target), head, total_tokens=6, depth=3, top_k=2),
    }


@pytest.mark.parametrize("method", ["eagle", "eagle2"])
def test_tree_sampling_preserves_target_distribution(tiny_vocab_target, tmp_path, method):
    expected = exact_joint(tiny_vocab_target, PROMPT, 3, SamplingConfig(temperature=1.0))
    decoder = tiny_tree_decoders(tiny_vocab_target, tmp_path)[method]
    samples = draw(decoder, 1200, seed=7)
    assert chi_square_pvalue(samples, expected) > 1e-3


@pytest.mark.parametrize("method", ["eagle", "eagle2"])
def test_tree_sampling_with_broken_acceptor_is_caught(tiny_vocab_target, tmp_path, method):
    """Forgetting to remove a rejected child from p (residual = p) favours rejected tokens."""
    expected = exact_joint(tiny_vocab_target, PROMPT, 3, SamplingConfig(temperature=1.0))
    decoder = tiny_tree_decoders(tiny_vocab_target, tmp_path)[method]
    decoder.sample_accept = lambda tree, probs, gen, **kw: type(decoder).sample_accept(
        tree, probs, gen, residual=lambda p, q: p, **kw
    )
    samples = draw(decoder, 1200, seed=7)
    assert chi_square_pvalue(samples, expected) < 1e-6


def test_eagle2_auto_total_tokens_times_the_target_through_the_profile_and_records_it(tmp_path):
    from methods.base import get_method
    from methods.machine.profile import MachineProfile

    target = tiny_model("llama", seed=46, vocab_size=64)
    write_eagle(tmp_path, target)
    context = BuildContext(target, "tiny", {"drafts": {"eagle": {"path": str(tmp_path)}}}, MachineProfile("cpu"))
    decoder = get_method("eagle2")(ModelRunner(target), {"name": "eagle2", "total_tokens": "auto"}, context)
    record = decoder.describe()
    chosen = record["sizing"]["chosen"]
    assert chosen in (40, 48, 50, 56, 60) and record["total_tokens"] == chosen == decoder.total_tokens
    assert set(record["sizing"]["seconds_by_size"]) == {40, 48, 50, 56, 60}
    assert decoder.target.length == 0  # the timing left no trace in the cache
    unprofiled = get_method("eagle2")(ModelRunner(target), {"name": "eagle2", "total_tokens": "auto"},
                                      BuildContext(target, "tiny", context.model_config))
    assert unprofiled.total_tokens == 60 and unprofiled.describe()["sizing"]["profile"].startswith("none")


def test_eagle2_adaptive_size_maximizes_expected_tokens_per_second(tmp_path):
    target = tiny_model("llama", seed=46, vocab_size=64)
    write_eagle(tmp_path, target)
    head = load_eagle_head(ModelSpec(path=str(tmp_path)), target)
    probabilities = [0.9, 0.8, 0.6, 0.3, 0.1, 0.05]
    flat = adaptive(ModelRunner(target), head, {1: 1.0, 64: 1.0})
    assert flat.adaptive_size(probabilities) == 6  # verifying more costs nothing: keep every candidate
    # cost grows by 0.25 per token: candidate n pays off while p_n / 0.25 beats the current rate
    steep = adaptive(ModelRunner(target), head, {1: 1.0, 2: 1.25, 4: 1.75, 8: 2.75, 64: 16.75})
    rates = [(1 + sum(probabilities[:n])) / (1 + 0.25 * n) for n in range(7)]
    assert steep.adaptive_size(probabilities) == max(range(7), key=rates.__getitem__) == 3
    assert steep.verify_time(3) == pytest.approx(1.5) and steep.verify_time(100) == pytest.approx(25.75)
    steep.draft_seconds = 100.0  # drafting dominates: verifying the whole tree costs relatively little
    assert steep.adaptive_size(probabilities) == 6
    dear = adaptive(ModelRunner(target), head, {1: 1.0, 2: 3.0, 64: 200.0})
    assert dear.adaptive_size(probabilities) == 0  # the root alone: an AR step
    # at batch size B each sequence pays t(B n) / B: a curve flat to 8 rows keeps every candidate alone,
    # and at B = 4 (a forward of 4 x its rows) stops where 4 (n + 1) passes 8
    bent = adaptive(ModelRunner(target), head, {1: 1.0, 8: 1.0, 16: 3.0, 64: 15.0})
    assert bent.adaptive_size(probabilities) == 6
    shares = [(1 + sum(probabilities[:n])) / (verify_cost(bent.verify_seconds, 4 * (n + 1)) / 4) for n in range(7)]
    assert bent.adaptive_size(probabilities, batch=4) == max(range(7), key=shares.__getitem__) == 1
    assert bent.adaptive_size(probabilities, greedy=False, batch=1) == 6


def test_eagle2_adaptive_builds_with_a_measured_curve_and_rejects_unknown_sizes(tmp_path):
    from methods.base import get_method
    from methods.machine.profile import CURVE_SIZES, MachineProfile

    target = tiny_model("llama", seed=46, vocab_size=64)
    write_eagle(tmp_path, target)
    context = BuildContext(target, "tiny", {"drafts": {"eagle": {"path": str(tmp_path)}}}, MachineProfile("cpu"))
    decoder = get_method("eagle2")(ModelRunner(target), {"name": "eagle2", "total_tokens": "adaptive"}, context)
    assert set(decoder.verify_seconds) == set(CURVE_SIZES) and decoder.target.length == 0
    assert decoder.describe()["total_tokens"] == "adaptive"
    prompt, stop = [1, 2, 3, 4], StopCondition(20)
    assert decoder.generate(prompt,
                            stop).tokens == AutoregressiveDecoder(ModelRunner(target)).generate(prompt, stop).tokens
    with pytest.raises(ValueError, match="method.total_tokens='big': valid: adaptive, auto or an integer >= 2"):
        get_method("eagle2")(ModelRunner(target), {"name": "eagle2", "total_tokens": "big"}, context)


def test_model_without_a_head_for_the_method_is_a_clear_error():
    target = tiny_model("llama", seed=47, vocab_size=64)
    context = BuildContext(target, "llama3-8b-instruct", {"drafts": {"eagle": {"path": "x"}, "medusa": None}})
    with pytest.raises(ValueError,
                       match=r"'medusa' needs a medusa draft, but model 'llama3-8b-instruct' names none.*eagle"):
        head_spec({"name": "medusa"}, context, "medusa")
