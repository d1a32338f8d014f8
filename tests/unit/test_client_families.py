"""Every served model type has client classes, made from its family's description (blocks/family.py
ModelFamily.client, peer/client/families.py), and they hold and use the client's tensors as
transformers' own model does: embeddings, the norms around the blocks, the LM head."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import bloompeer
from bloompeer import AutoDistributedModelForCausalLM, AutoDistributedModelForSequenceClassification
from bloompeer.blocks import FAMILIES, family_for_model_type, open_checkpoint, served_model_types
from bloompeer.peer.cli.default_model import write_random_checkpoint
from bloompeer.peer.client.families import client_classes


@pytest.mark.parametrize("family", FAMILIES, ids=lambda family: family.name)
def test_each_familys_classes_are_public_under_its_name(family):
    classes = client_classes(family.name)
    stem = f"Distributed{family.client.class_name}"
    assert getattr(bloompeer, f"{stem}Model") is classes.model
    assert getattr(bloompeer, f"{stem}ForCausalLM") is classes.causal_lm
    assert getattr(bloompeer, f"{stem}ForSequenceClassification") is classes.sequence_classification
    assert classes.causal_lm.__module__ == "bloompeer.peer.client.families"
    assert set(family.client.make_modules(_config(family.model_types[0]))) == set(family.client.module_names)


@pytest.mark.parametrize("model_type", served_model_types())
@torch.inference_mode()
def test_a_served_model_type_loads_into_its_familys_client_classes_as_transformers_reads_it(model_type, tmp_path):
    path = write_random_checkpoint(tmp_path / model_type, model_type=model_type, num_blocks=2, hidden_size=64,
                                   num_heads=4, tie_word_embeddings=False)
    checkpoint = open_checkpoint(path)
    family = family_for_model_type(model_type)
    ours_class = AutoDistributedModelForCausalLM.class_for(str(path))
    assert ours_class is client_classes(family.name).causal_lm
    assert AutoDistributedModelForSequenceClassification.class_for(str(path)) is \
        client_classes(family.name).sequence_classification
    ours = ours_class._with_local_tensors(checkpoint, checkpoint.config(), torch.float32, None, 0)
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    base = theirs.base_model
    ids = torch.tensor([[1, 5, 9, 3]])
    embeds = base.get_input_embeddings()(ids)
    torch.testing.assert_close(ours.remote.embed(ids), embeds, rtol=0, atol=0)
    first = getattr(base, family.client.embedding_norm) if family.client.embedding_norm else (lambda x: x)
    torch.testing.assert_close(ours.remote.to_swarm(embeds), first(embeds), rtol=0, atol=0)
    hidden = torch.randn(1, 4, 64)
    final = getattr(base, family.client.final_norm)(hidden)
    torch.testing.assert_close(ours.remote.final_norm(hidden), final, rtol=0, atol=0)
    torch.testing.assert_close(ours.lm_head(final), theirs.lm_head(final), rtol=0, atol=0)


def _config(model_type: str):
    return AutoConfig.for_model(model_type, hidden_size=64, num_attention_heads=4, num_hidden_layers=1, vocab_size=8)
