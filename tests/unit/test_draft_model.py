"""The draft model bundled with the demo model (bloompeer/demo_model/draft, scripts/train_draft_model.py):
small, loadable by our checkpoint loader and by transformers, with the demo model's tokenizer, shipped
as package data, and useful: assisted greedy decoding with it gives plain greedy's tokens in fewer
passes of the target."""

import configparser
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, BloomForCausalLM

from bloompeer.blocks import open_checkpoint
from bloompeer.peer.cli.default_model import DEMO_DRAFT_MODEL_DIR, DEMO_MODEL_DIR

MAX_WEIGHTS_BYTES = 6_000_000
REPO_ROOT = Path(__file__).resolve().parents[2]
NEW_TOKENS = 24


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Matrices of 256: a second thread only adds contention (on a busy CI machine, 10x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target() -> BloomForCausalLM:
    return BloomForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def draft() -> BloomForCausalLM:
    return BloomForCausalLM.from_pretrained(DEMO_DRAFT_MODEL_DIR, dtype=torch.float32).eval()


def test_the_draft_is_small_and_has_the_demo_models_tokenizer(target, draft):
    assert (DEMO_DRAFT_MODEL_DIR / "model.safetensors").stat().st_size <= MAX_WEIGHTS_BYTES
    assert draft.config.num_hidden_layers < target.config.n_layer
    assert draft.config.vocab_size == target.config.vocab_size
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (DEMO_DRAFT_MODEL_DIR / name).read_bytes() == (DEMO_MODEL_DIR / name).read_bytes(), name
    tokenizer = AutoTokenizer.from_pretrained(DEMO_DRAFT_MODEL_DIR)
    assert len(tokenizer) == target.config.vocab_size
    for token in ("pad", "bos", "eos"):
        assert getattr(draft.config, f"{token}_token_id") == getattr(target.config, f"{token}_token_id")
    assert draft.generation_config.num_assistant_tokens > 1  # the setting benchmarks/draft_acceptance.py chose


def test_our_checkpoint_loader_reads_the_same_blocks_as_transformers(draft):
    checkpoint = open_checkpoint(DEMO_DRAFT_MODEL_DIR)
    assert checkpoint.config().n_layer == draft.config.num_hidden_layers
    span = checkpoint.load_span(0, draft.config.num_hidden_layers, torch.float32)
    for ours, theirs in zip(span.blocks, draft.transformer.h, strict=True):
        expected = theirs.state_dict()
        assert all(torch.equal(tensor, expected[name]) for name, tensor in ours.state_dict().items())


def test_assisted_greedy_equals_plain_greedy_in_fewer_target_passes(target, draft):
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    heldout = (DEMO_MODEL_DIR / "heldout.txt").read_text(encoding="utf-8")
    prompt = torch.tensor([tokenizer(heldout)["input_ids"][:32]])
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=target.config.pad_token_id)
    passes = []
    hook = target.register_forward_pre_hook(lambda module, args: passes.append(1))
    try:
        with torch.inference_mode():
            plain = target.generate(prompt, **kwargs)
            plain_passes, passes[:] = len(passes), []
            assisted = target.generate(prompt, assistant_model=draft, **kwargs)
    finally:
        hook.remove()
    assert plain_passes == NEW_TOKENS
    assert assisted.tolist() == plain.tolist()
    assert len(passes) < NEW_TOKENS * 2 // 3, "the draft's proposals should save a third of the target's passes"


def test_the_draft_ships_as_package_data():
    """setup.cfg's package_data globs take every file of the draft directory into a wheel."""
    setup = configparser.ConfigParser()
    setup.read(REPO_ROOT / "setup.cfg")
    globs = setup["options.package_data"]["bloompeer"].split()
    shipped = {path for pattern in globs for path in (REPO_ROOT / "bloompeer").glob(pattern)}  # setuptools globs so
    files = {path for path in DEMO_DRAFT_MODEL_DIR.iterdir() if path.is_file()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= {f.name for f in files}
    assert files <= shipped, f"not in setup.cfg's package_data: {sorted(f.name for f in files - shipped)}"


def test_generate_draft_model_demo_is_the_bundled_draft_and_only_for_the_demo_model(tmp_path):
    from bloompeer.peer.cli import generate_command
    from bloompeer.peer.cli.main import build_parser
    from bloompeer.peer.cli.default_model import write_random_checkpoint

    args = build_parser().parse_args(["generate", "x", "--draft-model", "demo"])
    assert Path(args.draft_model) == DEMO_DRAFT_MODEL_DIR
    other = write_random_checkpoint(tmp_path / "other")
    args = build_parser().parse_args(["generate", "x", "--model", str(other), "--draft-model", "demo"])
    with pytest.raises(ValueError, match="--draft-model demo is the demo model's draft"):
        generate_command.run(args)  # refused before any swarm starts
