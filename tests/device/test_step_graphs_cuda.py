"""On a GPU only (scripts/device_check.sh runs it with --noconftest; tests/device/conftest.py keeps it from
being collected where torch sees no CUDA device, so it counts for nothing on the CPU): decode steps captured as CUDA graphs and replayed (blocks/step_graphs.py) against the
eager span, and greedy tokens through graphed steps against transformers' own model, in float32.

Needs no hivemind and no conftest (the GPU machine may lack both): tiny spans are built here."""

import pytest
import torch

from bloompeer.blocks import Segment, open_checkpoint
from bloompeer.blocks.families import family_for_model_type
from bloompeer.blocks.step_graphs import StepGraphs
from bloompeer.peer.cli.default_model import write_random_checkpoint

from ..helpers.tiny_spans import HIDDEN, random_span


LATENT = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, q_lora_rank=24,
              n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, n_shared_experts=1,
              first_k_dense_replace=1, n_group=4, topk_group=2)
DYNAMIC_ROPE = dict(max_position_embeddings=8, rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0))
HYBRID = dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
              linear_value_head_dim=16, linear_conv_kernel_dim=4,
              rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))
CASES = {"bloom": ("bloom", {}, 0, 4), "llama": ("llama", {}, 0, 4),
         "mistral": ("mistral", dict(sliding_window=5), 0, 4), "deepseek_v3": ("deepseek_v3", LATENT, 0, 1),
         "llama dynamic rope": ("llama", DYNAMIC_ROPE, 0, 4),  # grown past its trained length of 8
         "qwen3_5": ("qwen3_5_text", HYBRID, 0, 4),  # 3 Gated DeltaNet blocks, then gated attention
         # float32 experts, which torch._grouped_mm does not take on a GPU: every expert over the pass's rows
         "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=5), 0, 2)}
RECURRENT = {"qwen3_5"}  # its graphs read one of two state slots: one graph per parity (step_graphs.py)
STEPS = 8


@pytest.fixture(autouse=True)
def exact_float32():
    """float32 matmuls in float32 (no TF32), as transformers' own comparisons run."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.mark.parametrize("name", sorted(CASES))
@torch.inference_mode()
def test_replayed_graphs_equal_eager_steps_in_float32(name):
    """Two sessions (batch 2 with left padding, batch 1) after prompts, then STEPS one-token passes: eager on
    the first, captured on the second, replayed after (a recurrent span: each parity of its slots so); every output within 1e-5 of the eager span's (relative
    to its largest value; 2e-7 on the CPU, where the eager and static kernels are alike), and a
    replay bitwise what the captured function computes run again eagerly on the same buffers."""
    model_type, fields, start, end = CASES[name]
    span = random_span(model_type, fields, start, end, device="cuda")
    graphs = StepGraphs(span)
    generator = torch.Generator().manual_seed(1)
    prompts = [(torch.randn(2, 5, HIDDEN, generator=generator), torch.tensor([[0, 0, 1, 1, 1], [1] * 5]).bool()),
               (torch.randn(1, 3, HIDDEN, generator=generator), None)]
    eager, graphed = ([span.new_cache(start, end, hidden.shape[0], 32, torch.float32, "cuda") for hidden, _ in prompts]
                      for _ in range(2))
    for caches in (eager, graphed):
        for cache, (hidden, mask) in zip(caches, prompts):
            span(hidden.cuda(), cache.begin_step(0, None if mask is None else mask.cuda(), hidden.shape[1]), cache)
    worst = 0.0
    for _ in range(STEPS):
        new = [torch.randn(hidden.shape[0], 1, HIDDEN, generator=generator).cuda() for hidden, _ in prompts]
        expected = span.forward_segments(
            [Segment(hidden, cache.begin_step(cache.length, None, 1), cache) for hidden, cache in zip(new, eager)])
        outputs = graphs.forward(
            [Segment(hidden, cache.begin_step(cache.length, None, 1), cache) for hidden, cache in zip(new, graphed)],
            start, end)
        worst = max(worst, *(float((output - reference).abs().max() / reference.abs().max())
                             for output, reference in zip(outputs, expected)))
    per_set = 2 if name in RECURRENT else 1
    assert graphs.counts == {"eager": per_set, "capture": per_set, "replay": STEPS - 2 * per_set}, graphs.counts
    print(f"{name}: graphed vs eager, largest difference {worst:.2e} of the largest value")
    assert worst <= 1e-5
    for step, replay in graphs.keys.graphs.values():
        replayed = [output.clone() for output in replay()]
        rerun = step.run()
        assert all(torch.equal(a, b) for a, b in zip(replayed, rerun))


MIXTRAL = dict(num_local_experts=4, num_experts_per_tok=2)


@pytest.mark.parametrize("model_type, fields, end, quant, dtype, bound", [
    ("bloom", {}, 4, "int8", torch.float32, 1e-5), ("bloom", {}, 4, "int4", torch.bfloat16, 3e-2),
    ("mixtral", MIXTRAL, 2, None, torch.bfloat16, 3e-2), ("mixtral", MIXTRAL, 2, "int8", torch.bfloat16, 3e-2)])
@torch.inference_mode()
def test_quantized_and_expert_spans_replay_graphs_too(model_type, fields, end, quant, dtype, bound):
    """`serve --quant`: BLOOM blocks with int8 (float32 rows) or int4 (bfloat16, its kernel's) weights, quantized
    on the GPU as a server's loader does; Mixtral's experts in bfloat16, stacked (one torch._grouped_mm a layer),
    or int8 (every expert over the pass's row). Their captured steps replay within `bound` of the eager step
    (relative to the largest value; bfloat16's rounding, the masked keys summed in)."""
    from bloompeer.blocks.quantized_linear import quantize_block
    from bloompeer.weight_format import WeightFormat

    span = random_span(model_type, fields, 0, end, device="cuda").to(dtype)
    for block in span.blocks if quant else ():
        quantize_block(block, WeightFormat.of(quant, 32, str(dtype).removeprefix("torch."), "cuda"))
    graphs = StepGraphs(span)
    assert all((moe.stacked is None) == bool(quant) for moe in span.modules() if hasattr(moe, "stacked"))
    generator = torch.Generator().manual_seed(4)
    eager, graphed = (span.new_cache(0, end, 1, 32, dtype, "cuda") for _ in range(2))
    prompt = torch.randn(1, 4, HIDDEN, generator=generator).to("cuda", dtype)
    for cache in (eager, graphed):
        span(prompt, cache.begin_step(0, None, 4), cache)
    worst = 0.0
    for _ in range(STEPS):
        hidden = torch.randn(1, 1, HIDDEN, generator=generator).to("cuda", dtype)
        expected = span(hidden, eager.begin_step(eager.length, None, 1), eager)
        output, = graphs.forward([Segment(hidden, graphed.begin_step(graphed.length, None, 1), graphed)], 0, end)
        worst = max(worst, float((output - expected).abs().max() / expected.abs().max()))
    assert graphs.counts == {"eager": 1, "capture": 1, "replay": STEPS - 2}, (graphs.counts, graphs.broken)
    print(f"{model_type} {quant or dtype}: graphed vs eager, largest difference {worst:.2e} of the largest value")
    assert worst <= bound


@pytest.mark.parametrize("model_type", ["bloom", "llama"])
@torch.inference_mode()
def test_greedy_tokens_through_graphed_steps_equal_transformers(model_type, tmp_path):
    """transformers' model on the GPU generates 16 tokens greedily; the same through its embeddings, our span
    (the prompt eagerly, every step after through StepGraphs) and its head gives the same tokens."""
    from transformers import AutoModelForCausalLM

    path = write_random_checkpoint(tmp_path / model_type, model_type=model_type, num_blocks=4, hidden_size=HIDDEN,
                                   num_heads=4, seed=2, initializer_range=0.15)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]], device="cuda")
    reference.generation_config.eos_token_id = None  # 16 tokens whatever they are (ours never stops either)
    expected = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                                  pad_token_id=0)[0, ids.shape[1]:].tolist()
    span = open_checkpoint(path).load_span(0, 4, torch.float32, "cuda")
    graphs = StepGraphs(span)
    parts = family_for_model_type(reference.config.model_type).client
    base = reference.base_model
    norms = [getattr(base, parts.embedding_norm)] if parts.embedding_norm else []

    def embed(tokens):
        hidden = getattr(base, parts.embeddings)(tokens)
        return norms[0](hidden) if norms else hidden

    def next_token(hidden):
        return int(reference.lm_head(getattr(base, parts.final_norm)(hidden[:, -1])).argmax(-1))

    cache = span.new_cache(0, 4, 1, 32, torch.float32, "cuda")
    tokens = [next_token(span(embed(ids), cache.begin_step(0, None, ids.shape[1]), cache))]
    while len(tokens) < 16:
        hidden = embed(torch.tensor([[tokens[-1]]], device="cuda"))
        tokens.append(next_token(graphs.forward([Segment(hidden, cache.begin_step(cache.length, None, 1), cache)],
                                                0, 4)[0]))
    assert graphs.counts["replay"] == 13
    assert tokens == expected


@torch.inference_mode()
def test_a_servers_scheduler_replays_graphs_for_decode_steps():
    """The serving path: a Scheduler on a CUDA span runs two sessions' one-token steps (sent as a server's
    handlers send them, on the CPU) through StepGraphs, batched in passes, and answers what the eager span
    computes (within 1e-5 of the largest value). Needs hivemind (the scheduler's frames come from p2p)."""
    pytest.importorskip("hivemind")
    import asyncio

    from bloompeer.p2p import Step
    from bloompeer.peer.server.compute import ComputeWorker
    from bloompeer.peer.server.scheduler import Scheduler

    span = random_span("bloom", {}, 0, 4, device="cuda")
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randn(1, 4, HIDDEN, generator=generator) for _ in range(2)]
    steps = [[torch.randn(1, 1, HIDDEN, generator=generator) for _ in range(2)] for _ in range(STEPS)]

    async def serve() -> tuple[list, Scheduler]:
        compute = ComputeWorker("cuda")
        scheduler = Scheduler(span, compute, max_batch_tokens=2048, device="cuda", dtype=torch.float32)
        runner = asyncio.create_task(scheduler.run())
        caches = [span.new_cache(0, 4, 1, 32, torch.float32, "cuda") for _ in prompts]
        try:
            for index, (cache, prompt) in enumerate(zip(caches, prompts)):
                await scheduler.step(f"s{index}", cache, Step(0, prompt))
            outputs = []
            for hidden in steps:
                outputs.append(await asyncio.gather(*(
                    scheduler.step(f"s{index}", cache, Step(cache.length, h))
                    for index, (cache, h) in enumerate(zip(caches, hidden)))))
            return outputs, scheduler
        finally:
            await scheduler.stop()
            runner.cancel()
            compute.shutdown()

    outputs, scheduler = asyncio.run(serve())
    assert scheduler.step_graphs.counts["replay"] >= 1, scheduler.step_graphs.counts
    caches = [span.new_cache(0, 4, 1, 32, torch.float32, "cuda") for _ in prompts]
    for cache, prompt in zip(caches, prompts):
        span(prompt.cuda(), cache.begin_step(0, None, 4), cache)
    for hidden, answered in zip(steps, outputs):
        for cache, h, output in zip(caches, hidden, answered):
            expected = span(h.cuda(), cache.begin_step(cache.length, None, 1), cache).cpu()
            assert float((output - expected).abs().max() / expected.abs().max()) <= 1e-5
