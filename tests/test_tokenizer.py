"""Tokenizer loading: tokenizer.json only, special-token facts from the config files,
parity with transformers' own tokenizer on a model directory it wrote."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loramux_core.errors import ModelLoadError
from loramux_core.tokenizer import Tokenizer
from tests.support.tiny import BOS_ID, EOS_ID, build_tokenizer, make_model, write_json

TEXT = "héllo wörld, 你好 🙂🚀 the quick brown fox"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("model"))


def tokenizer_dir(tmp_path, tok_cfg=None, gen_cfg=None, model_cfg=None):
    build_tokenizer().save(str(tmp_path / "tokenizer.json"))
    for name, cfg in (("tokenizer_config.json", tok_cfg), ("generation_config.json", gen_cfg),
                      ("config.json", model_cfg)):
        if cfg is not None:
            write_json(tmp_path / name, cfg)
    return tmp_path


def test_matches_transformers_on_a_model_dir(model_dir):
    from transformers import AutoTokenizer

    ours, hf = Tokenizer.from_dir(model_dir), AutoTokenizer.from_pretrained(model_dir)
    for add in (True, False):
        assert ours.encode(TEXT, add_special_tokens=add) == hf(
            TEXT, add_special_tokens=add).input_ids
    ids = ours.encode(TEXT)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True) == TEXT
    with_eos = ids + [EOS_ID]
    assert ours.decode(with_eos, skip_special_tokens=False) == hf.decode(with_eos) == TEXT + "</s>"
    assert ours.decode(with_eos) == TEXT
    assert ours.vocab_size == len(hf)
    assert ours.eos_token_ids == (EOS_ID,) and ours.bos_token_id == BOS_ID
    assert ours.is_special(EOS_ID) and ours.is_special(BOS_ID) and not ours.is_special(ids[0])
    assert ours.id_to_token(ids[0]) == hf.convert_ids_to_tokens(ids[0])
    assert ours.id_to_token(10**6) is None


def test_eos_from_generation_config_wins(tmp_path):
    tok = Tokenizer.from_dir(tokenizer_dir(tmp_path, {"eos_token": "</s>"},
                                           {"eos_token_id": [1, 2]}, {"eos_token_id": 0}))
    assert tok.eos_token_ids == (1, 2)


def test_eos_from_config_json_when_generation_config_has_none(tmp_path):
    tok = Tokenizer.from_dir(tokenizer_dir(tmp_path, {"eos_token": "</s>"},
                                           {"bos_token_id": 0}, {"eos_token_id": 2}))
    assert tok.eos_token_ids == (2,)


def test_eos_from_tokenizer_when_no_config_names_one(tmp_path):
    tok = Tokenizer.from_dir(tokenizer_dir(tmp_path, {"eos_token": {"content": "<pad>"}}))
    assert tok.eos_token_ids == (2,)
    bare = tmp_path / "bare"
    bare.mkdir()
    assert Tokenizer.from_dir(tokenizer_dir(bare)).eos_token_ids == ()


def test_bad_eos_field_is_refused(tmp_path):
    with pytest.raises(ModelLoadError, match=r"generation_config.json: eos_token_id='x'"):
        Tokenizer.from_dir(tokenizer_dir(tmp_path, gen_cfg={"eos_token_id": "x"}))


def test_special_tokens_come_from_the_post_processor(tmp_path):
    from tokenizers import processors
    from transformers import AutoTokenizer

    cases = {"flags_only": (None, True), "template": ("<s> $A:0 </s>", False)}
    for name, (template, flag) in cases.items():
        d = tmp_path / name
        d.mkdir()
        backend = build_tokenizer()
        if template:
            backend.post_processor = processors.TemplateProcessing(
                single=template, special_tokens=[("<s>", BOS_ID), ("</s>", EOS_ID)])
        backend.save(str(d / "tokenizer.json"))
        write_json(d / "tokenizer_config.json", {"bos_token": "<s>", "eos_token": "</s>",
                                                  "add_bos_token": flag, "add_eos_token": flag})
        ours, hf = Tokenizer.from_dir(d), AutoTokenizer.from_pretrained(d)
        ids = ours.encode("the fox")
        assert ids == hf("the fox").input_ids, name
        assert (ids[0] == BOS_ID and ids[-1] == EOS_ID) == bool(template), name
        assert ours.encode("the fox", add_special_tokens=False) == [
            i for i in ids if i not in (BOS_ID, EOS_ID)]


def test_truncation_in_tokenizer_json_is_ignored(tmp_path):
    backend = build_tokenizer()
    backend.enable_truncation(max_length=3)
    backend.save(str(tmp_path / "tokenizer.json"))
    assert len(Tokenizer.from_dir(tmp_path).encode(TEXT)) > 3


def test_missing_tokenizer_json_is_refused(tmp_path):
    write_json(tmp_path / "tokenizer_config.json", {"eos_token": "</s>"})
    (tmp_path / "tokenizer.model").write_bytes(b"not loaded")
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_corrupt_files_are_refused(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="tokenizer.json: cannot load"):
        Tokenizer.from_dir(tmp_path)
    build_tokenizer().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "generation_config.json").write_text("[1, 2")
    with pytest.raises(ModelLoadError, match="generation_config.json: cannot read JSON"):
        Tokenizer.from_dir(tmp_path)


def test_tokenizer_and_detokenizer_import_without_torch(tmp_path):
    # The gateway uses both without torch: importing them must not pull torch in.
    code = ("import sys, importlib.util, types\n"
            "pkg = types.ModuleType('loramux_engine')\n"
            f"pkg.__path__ = [{str(Path(__file__).parents[1] / 'engine')!r}]\n"
            "sys.modules['loramux_engine'] = pkg\n"
            "import loramux_core.tokenizer, loramux_engine.detokenizer\n"
            "print(json.dumps('torch' in sys.modules))")
    out = subprocess.run([sys.executable, "-c", "import json\n" + code], capture_output=True,
                         text=True, check=True)
    assert json.loads(out.stdout) is False
