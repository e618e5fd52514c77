"""The embedded SmolLM2-135M-Instruct: conversion traps, numbers, a real answer."""

import json

import pytest

from llmctl.models.info import model_info

pytestmark = pytest.mark.slow


def test_parameter_count_and_shape(smollm2):
    info = model_info(smollm2, "embedded")
    assert info.parameters == 134_515_008
    assert (info.layers, info.hidden_size, info.heads, info.kv_heads) == (30, 576, 9, 3)
    assert (info.vocab_size, info.context_length) == (49152, 8192)
    assert info.tied_embeddings and info.quantization is None


def test_trap1_checkpoint_is_a_normal_savable_model(smollm2, tmp_path):
    from transformers import AutoModelForCausalLM

    config = json.loads((smollm2 / "config.json").read_text())
    assert "quantization_config" not in config
    model = AutoModelForCausalLM.from_pretrained(str(smollm2))
    model.save_pretrained(str(tmp_path / "resaved"))
    assert (tmp_path / "resaved" / "model.safetensors").is_file()


def test_trap2_eos_is_im_end(smollm2):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2))
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert tok.pad_token_id == 2
    assert json.loads((smollm2 / "generation_config.json").read_text())["eos_token_id"] == 2


def test_trap3_rope_theta_is_written_for_transformers4_readers(smollm2):
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["rope_theta"] == 100000.0
    assert config["rope_parameters"]["rope_theta"] == 100000.0


def test_trap4_tokenizer_class_is_known_to_transformers4(smollm2):
    from transformers import PreTrainedTokenizerFast

    tok_config = json.loads((smollm2 / "tokenizer_config.json").read_text())
    assert tok_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    tok = PreTrainedTokenizerFast.from_pretrained(str(smollm2))
    assert tok("Hello world")["input_ids"] == [19556, 905]


def test_greedy_chat_answer_mentions_paris(smollm2):
    from llmctl.models.hf_generate import hf_generate
    from llmctl.models.loading import load_model, load_tokenizer
    from llmctl.models.prompting import encode_prompt

    tok = load_tokenizer(smollm2)
    ids = encode_prompt(tok, "What is the capital of France?", chat=True)
    out = hf_generate(load_model(smollm2), tok, ids, max_tokens=24)
    assert "Paris" in tok.decode(out, skip_special_tokens=True)
