"""The volunteer image: built in the background from the start of the session, tested last.

The build starts once collection has found these tests, so that its minutes of downloads and
unpacking overlap the rest of the suite; these tests are moved to the end of the run and wait for
it. Without root, buildah or debootstrap, they fail saying so (they never skip).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, BloomForCausalLM

from bloompeer.peer.cli.default_model import DEMO_MODEL_DIR

from .build import ImageBuild

HERE = Path(__file__).resolve().parent
BUILD_TIMEOUT_S = 20 * 60  # from the start of the build; a cold build alone takes about 8 minutes here
PROMPT = "Once upon a time"
IMAGE_TAG = "localhost/bloompeer:test"  # one name, kept: the next build reuses its layers
_build_key = pytest.StashKey[ImageBuild]()


def _is_image_test(item: pytest.Item) -> bool:
    return HERE in Path(item.path).resolve().parents


def pytest_collection_modifyitems(session, config, items):
    """The image tests last, giving the build the whole rest of the session."""
    items.sort(key=_is_image_test)  # stable: every other test keeps its place


def pytest_collection_finish(session):
    if session.config.option.collectonly or not any(_is_image_test(item) for item in session.items):
        return
    build = ImageBuild(tag=IMAGE_TAG)
    session.config.stash[_build_key] = build
    build.start()


def pytest_sessionfinish(session):
    build = session.config.stash.get(_build_key, None)
    if build is not None:
        build.stop()


def pytest_terminal_summary(terminalreporter, config):
    build = config.stash.get(_build_key, None)
    if build is not None and build.process is not None:
        terminalreporter.write_line(f"image build:\n{build.report or build.log_tail()}")


@pytest.fixture(scope="session")
def image(request) -> str:
    """The image's name, once the background build has finished."""
    build = request.config.stash.get(_build_key, None)
    if build is None:
        pytest.fail("no image build in this session (it starts when tests/image is collected)")
    try:
        return build.wait(BUILD_TIMEOUT_S)
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def demo_continuation() -> str:
    """What `bloompeer generate "Once upon a time"` must print after the prompt: the demo model
    through transformers on this host, greedy, 32 new tokens (generate's defaults)."""
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    reference = BloomForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.inference_mode():
        expected = reference.generate(ids, max_new_tokens=32, do_sample=False, pad_token_id=0)
    return tokenizer.decode(expected[0, ids.shape[1]:], skip_special_tokens=True)
