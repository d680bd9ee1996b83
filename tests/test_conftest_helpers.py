import os

import numpy as np
import torch
from transformers import AutoModelForCausalLM


def test_synthetic_artifacts_follow_contract(synthetic_out):
    sids = np.load(os.path.join(synthetic_out, "sids.npy"))
    assert sids.dtype == np.int64 and len({tuple(r) for r in sids}) == len(sids)
    ds = torch.load(os.path.join(synthetic_out, "dataset.pt"), weights_only=True)
    assert len(ds["train"]) == len(ds["valid"]) == len(ds["user_ids"])


def test_tiny_model_loads(tiny_untied_model):
    m = AutoModelForCausalLM.from_pretrained(tiny_untied_model)
    assert not m.config.tie_word_embeddings
    assert m.get_input_embeddings().weight.data_ptr() != m.get_output_embeddings().weight.data_ptr()
