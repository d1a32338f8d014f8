"""Fine-tuning through the swarm: exact gradients, prompt tuning that converges (also with 8-bit
activations on the wire), a trainable classification head, frozen server weights, and a server
killed in the middle of a backward pass."""

import asyncio
import signal

import pytest
import torch
from transformers import BloomConfig, BloomForCausalLM

from bloompeer import (
    ClientConfig, DistributedBloomForCausalLM, DistributedBloomForSequenceClassification, NetworkConfig,
)
from bloompeer.p2p import BACKWARD_PROTOCOL, BackwardRequest, PeerNode, read_frame, write_frame
from bloompeer.peer.cli.default_model import write_byte_tokenizer
from bloompeer.peer.cli.local_swarm import LocalSwarm
from tests.wire import raw_stream

from .deep_prompts import deep_prompts_in, reference_prompt_gradients

PRE_SEQ_LEN = 4
TARGET = 7  # the synthetic task: predict this token at every position


@pytest.fixture(scope="module")
def steerable_checkpoint(tmp_path_factory):
    """A tiny BLOOM with larger random weights than BLOOM's init: prompts can steer it, as they can
    a trained model (the usual 0.02 init leaves a tiny model nearly deaf to its context)."""
    directory = tmp_path_factory.mktemp("steerable-bloom")
    vocab = write_byte_tokenizer(directory)
    torch.manual_seed(0)
    config = BloomConfig(vocab_size=vocab, hidden_size=64, n_layer=4, n_head=4, initializer_range=0.3,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    BloomForCausalLM(config).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def training_swarm(swarm, fork_server, steerable_checkpoint, tmp_path_factory):
    with LocalSwarm(steerable_checkpoint, [(0, 4), (0, 2), (2, 4)], log_dir=tmp_path_factory.mktemp("training-logs"),
                    launch=fork_server.launch) as training:
        yield training


def _client(cls, training_swarm, checkpoint, **kwargs):
    config = ClientConfig(NetworkConfig(initial_peers=tuple(training_swarm.initial_peers), client_mode=True),
                          request_timeout_s=5.0, poll_period_s=0.5, **kwargs.pop("config", {}))
    return cls.from_pretrained(checkpoint, client_config=config, **kwargs)


def test_gradients_equal_hf_for_input_embeddings_and_deep_prompts(training_swarm, steerable_checkpoint):
    reference = BloomForCausalLM.from_pretrained(steerable_checkpoint, dtype=torch.float32).eval()
    with _client(DistributedBloomForCausalLM, training_swarm, steerable_checkpoint, tuning_mode="deep_ptune",
                 pre_seq_len=PRE_SEQ_LEN) as model:
        torch.manual_seed(1)
        prompts = model.transformer.prompt_embeddings.weight
        deep = model.transformer.intermediate_prompt_embeddings.weight
        with torch.no_grad():
            deep.normal_(std=0.3)  # not zero, so every block's prompts matter
        ids = torch.randint(10, 250, (2, 6))
        embeds = model.transformer.word_embeddings(ids).detach().requires_grad_()
        model(inputs_embeds=embeds, labels=ids).loss.backward()

        ref_embeds = embeds.detach().clone().requires_grad_()
        ref_prompts_grad, ref_deep_grad = reference_prompt_gradients(reference, reference.transformer.h, ref_embeds,
                                                                     ids, prompts, deep)
        for ours, theirs in [(embeds.grad, ref_embeds.grad), (prompts.grad, ref_prompts_grad),
                             (deep.grad, ref_deep_grad)]:
            assert theirs.abs().max() > 0
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-8)


def _train(model, steps, lr=0.1, on_step=None):
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=lr)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for step in range(steps):
        ids = torch.randint(10, 250, (8, 12), generator=generator)
        logits = model(ids).logits
        if on_step is not None:
            on_step(step, logits)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 torch.full((ids.numel(),), TARGET))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("codec", ["raw", "int8-blockwise"])
def test_deep_prompt_tuning_converges(training_swarm, steerable_checkpoint, codec):
    with _client(DistributedBloomForCausalLM, training_swarm, steerable_checkpoint, tuning_mode="deep_ptune",
                 pre_seq_len=PRE_SEQ_LEN, config={"wire_codec": codec}) as model:
        assert all(not p.requires_grad for n, p in model.named_parameters() if "prompt" not in n)
        losses = _train(model, steps=40)
    assert losses[0] > 3.0  # an untrained prompt is far from the task ...
    assert losses[-1] < 1.0  # ... a tuned one solves it


def test_generation_with_trained_input_prompts_equals_hf(training_swarm, steerable_checkpoint):
    """ptune prompts stay in the servers' caches before the text; tokens equal HF generating from
    [prompts; text] embeddings, and differ from generating without the prompts."""
    reference = BloomForCausalLM.from_pretrained(steerable_checkpoint, dtype=torch.float32).eval()
    ids = torch.randint(10, 250, (2, 5), generator=torch.Generator().manual_seed(3))
    with _client(DistributedBloomForCausalLM, training_swarm, steerable_checkpoint, tuning_mode="ptune",
                 pre_seq_len=PRE_SEQ_LEN) as model:
        prompts = model.transformer.prompt_embeddings.weight
        with torch.no_grad():
            prompts.normal_(std=1.0, generator=torch.Generator().manual_seed(4))
            ours = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
            with model.inference_session(max_length=16):  # the same, one token at a time in a kept session
                stepwise = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
                stepwise = model.generate(stepwise, max_new_tokens=3, do_sample=False, pad_token_id=0)
            embeds = torch.cat([prompts.expand(2, -1, -1), reference.transformer.word_embeddings(ids)], dim=1)
            expected = reference.generate(inputs_embeds=embeds, max_new_tokens=6, do_sample=False, pad_token_id=0)
            unprompted = reference.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(ours[:, 5:], expected) and torch.equal(stepwise, ours)
    assert not torch.equal(ours, unprompted)


@pytest.mark.parametrize("push", [False, True], ids=["no-push", "push"])
def test_generation_with_deep_prompts_equals_hf(training_swarm, steerable_checkpoint, push):
    """Deep prompts go with the session's first step (never pushed: each server gets its own
    blocks' part) and stay in the servers' caches; greedy tokens equal HF's with the same prompts
    added before every block, decoding by full forwards."""
    reference = BloomForCausalLM.from_pretrained(steerable_checkpoint, dtype=torch.float32).eval()
    ids = torch.randint(10, 250, (2, 5), generator=torch.Generator().manual_seed(5))
    with _client(DistributedBloomForCausalLM, training_swarm, steerable_checkpoint, tuning_mode="deep_ptune",
                 pre_seq_len=PRE_SEQ_LEN, config={"push": push}) as model, torch.no_grad():
        generator = torch.Generator().manual_seed(6)
        prompts = model.transformer.prompt_embeddings.weight.normal_(std=1.0, generator=generator)
        deep = model.transformer.intermediate_prompt_embeddings.weight.normal_(std=1.0, generator=generator)
        ours = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        without_deep = deep.clone().zero_()
        per_block = deep.view(PRE_SEQ_LEN, 4, -1).permute(1, 0, 2)
        expected = _greedy_with_deep_prompts(reference, ids, prompts, per_block, 6)
        assert not torch.equal(expected, _greedy_with_deep_prompts(reference, ids, prompts, without_deep.view(
            PRE_SEQ_LEN, 4, -1).permute(1, 0, 2), 6))  # the deep prompts matter
    assert torch.equal(ours, expected)


def _greedy_with_deep_prompts(reference, ids, prompts, per_block, new_tokens):
    with deep_prompts_in(reference.transformer.h, per_block):
        finished = torch.zeros(ids.shape[0], 1, dtype=torch.bool)
        for _ in range(new_tokens):  # as generate() does: after EOS a row gets padding
            embeds = torch.cat([prompts.expand(ids.shape[0], -1, -1), reference.transformer.word_embeddings(ids)], 1)
            next_ids = reference(inputs_embeds=embeds, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, next_ids.masked_fill(finished, reference.config.pad_token_id)], dim=1)
            finished |= next_ids == reference.config.eos_token_id
        return ids


def test_classification_head_and_prompts_train(training_swarm, steerable_checkpoint):
    """Label: is the last token's id even? Only the head and the prompts learn (to fit one batch:
    a tiny random model cannot generalise parity, and fresh batches made the test a coin toss)."""
    torch.manual_seed(0)  # the head's and prompts' initialisation
    with _client(DistributedBloomForSequenceClassification, training_swarm, steerable_checkpoint,
                 tuning_mode="ptune", pre_seq_len=PRE_SEQ_LEN, num_labels=2) as model:
        optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.05)
        ids = torch.randint(10, 250, (16, 6), generator=torch.Generator().manual_seed(0))
        losses = []
        for _ in range(30):
            loss = model(ids, labels=ids[:, -1] % 2).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


async def test_a_client_cannot_change_server_weights(training_swarm, steerable_checkpoint):
    """There is no RPC that writes weights; a backward that asks for more is refused; and the
    servers' outputs are the same after training steps as before."""
    server = training_swarm.servers[0]
    node = await PeerNode.create(NetworkConfig(initial_peers=tuple(training_swarm.initial_peers), client_mode=True))
    try:
        reader, writer = await raw_stream(node, server, BACKWARD_PROTOCOL)
        hidden = torch.randn(1, 3, 64)
        frame = {**BackwardRequest(steerable_checkpoint.name, 0, 4, hidden, hidden).to_wire(),
                 "update_weights": True, "learning_rate": 1.0}
        await write_frame(writer, frame)
        reply = await asyncio.wait_for(read_frame(reader), 30)
        writer.close()
        assert reply["type"] == "error" and reply["code"] == "bad_request"
    finally:
        await node.shutdown()

    def logits_now():
        with _client(DistributedBloomForCausalLM, training_swarm, steerable_checkpoint) as plain:
            with torch.inference_mode():
                return plain(torch.tensor([[5, 6, 7, 8]])).logits

    before = logits_now()
    with _client(DistributedBloomForCausalLM, training_swarm, steerable_checkpoint, tuning_mode="deep_ptune",
                 pre_seq_len=PRE_SEQ_LEN) as model:
        _train(model, steps=3)
    assert torch.equal(logits_now(), before)


def test_training_survives_a_server_killed_during_backward(training_swarm, steerable_checkpoint):
    """The same training twice: once untouched, once with the route's server killed between a
    forward and its backward. The losses are the same: the backward was routed around the dead
    server (recomputing the forward on the new route) and training went on."""

    def run(on_step=None):
        torch.manual_seed(0)  # the same initial prompts
        with _client(DistributedBloomForCausalLM, training_swarm, steerable_checkpoint, tuning_mode="deep_ptune",
                     pre_seq_len=PRE_SEQ_LEN) as model:
            return _train(model, steps=8, on_step=on_step and (lambda step, logits: on_step(model, step, logits)))

    fault_free = run()
    killed = []

    def kill_during_backward(model, step, logits):
        if step == 3:
            route = model.transformer.client.swarm.servers  # the view; the route of this forward is the fastest
            victim = next(s for s in training_swarm.servers if s.blocks == (0, 4))
            assert any(r.peer_id == victim.peer_id_str for r in route[0])
            logits.register_hook(lambda grad: (killed.append(victim), victim.signal(signal.SIGKILL), grad)[-1])

    with_fault = run(kill_during_backward)
    assert killed and killed[0].process.wait(timeout=10) == -signal.SIGKILL
    assert with_fault == pytest.approx(fault_free, rel=1e-5)


def test_a_large_batch_travels_in_parts_with_the_same_gradients(training_swarm, steerable_checkpoint):
    def gradients(max_rows):
        torch.manual_seed(0)
        config = {"max_rows_per_request": max_rows}
        with _client(DistributedBloomForCausalLM, training_swarm, steerable_checkpoint, tuning_mode="deep_ptune",
                     pre_seq_len=PRE_SEQ_LEN, config=config) as model:
            ids = torch.randint(10, 250, (6, 10), generator=torch.Generator().manual_seed(1))
            model(ids, labels=ids).loss.backward()
            return [p.grad for p in model.parameters() if p.requires_grad]

    for whole, parts in zip(gradients(4096), gradients(30)):  # 6 x 14 rows: one request, or three
        torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-8)
