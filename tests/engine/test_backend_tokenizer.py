"""An engine's tokenizer kept on the machine and read back without transformers
(engine/text/backend_tokenizer.py): it decodes every token and sequence as transformers' own
tokenizer does, holds the same values, hands everything else to that tokenizer; a tokenizer whose
decode is not its Rust tokenizer's is never kept; an engine whose tokenizer was kept imports no
transformers and streams the text transformers decodes."""
from __future__ import annotations

import json
import pickle
import random
import shutil
import subprocess
import sys

import pytest
from helpers import SIM_PROFILE

import engine.text.backend_tokenizer as backend_tokenizer
from engine.text.backend_tokenizer import KEPT, BackendTokenizer, engine_tokenizer
from engine.text.tokenizer import IncrementalDetokenizer

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Hello, world! It's 12:30 - café, naïve.",
         "Ein Beispiel; ¿qué tal?"] * 20


def _metaspace_bpe(out: str) -> None:
    """A SentencePiece-style BPE (▁ for spaces) under transformers' Llama tokenizer class."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import LlamaTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"]))
    LlamaTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>").save_pretrained(out)


def _wordpiece_cleaned_up(out: str) -> None:
    """A BERT WordPiece tokenizer that cleans up spaces when decoding (its class's default)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import BertTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    specials = ["[UNK]", "[CLS]", "[SEP]"]
    tok.train_from_iterator(TEXTS, trainers.WordPieceTrainer(vocab_size=200, special_tokens=specials))
    BertTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=True).save_pretrained(out)


@pytest.mark.parametrize("kind", ["byte_level_bpe", "metaspace_bpe"])
def test_a_kept_tokenizer_decodes_as_transformers_does(kind, smol_tokenizer, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("PDSERVE_TOKENIZER_CACHE", str(tmp_path / "cache"))
    path = str(tmp_path / kind)
    if kind == "byte_level_bpe":
        smol_tokenizer.save_pretrained(path)             # the embedded model's (SmolLM2's) tokenizer
    else:
        _metaspace_bpe(path)
    theirs = AutoTokenizer.from_pretrained(path)
    assert not isinstance(engine_tokenizer(path, None), BackendTokenizer)    # loaded, and kept
    assert engine_tokenizer(path, None) is engine_tokenizer(path, None)      # once per process
    monkeypatch.setattr(backend_tokenizer, "_IN_PROCESS", {})                # (as the next process)
    ours = engine_tokenizer(path, None)
    assert isinstance(ours, BackendTokenizer)

    rng = random.Random(0)
    n = len(theirs)
    sequences = [[i] for i in range(n)] + [[rng.randrange(n) for _ in range(rng.randint(2, 40))] for _ in range(300)]
    for skip in (False, True):
        assert [ours.decode(s, skip_special_tokens=skip) for s in sequences] == \
            [theirs.decode(s, skip_special_tokens=skip) for s in sequences], skip
    assert [ours.decode(i) for i in range(n)] == [theirs.decode(i) for i in range(n)]
    for name in KEPT:
        assert getattr(ours, name) == getattr(theirs, name), name
    text = TEXTS[1] + " <s> 12345"
    assert ours.encode(text) == theirs.encode(text)          # (the HF tokenizer's, loaded on first use)
    assert ours.chat_template == theirs.chat_template
    # The detokenizer streams what transformers decodes of the whole (from the backend directly).
    ids = [rng.randrange(n) for _ in range(60)]
    detokenizer = IncrementalDetokenizer(engine_tokenizer(path, None), [], skip_special_tokens=True)
    streamed = "".join(detokenizer.update([t]) for t in ids)
    assert detokenizer._backend is not None and streamed == theirs.decode(ids, skip_special_tokens=True)


def test_a_tokenizer_that_cleans_up_spaces_is_not_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_TOKENIZER_CACHE", str(tmp_path / "cache"))
    path = str(tmp_path / "wordpiece")
    _wordpiece_cleaned_up(path)
    for _ in range(2):
        monkeypatch.setattr(backend_tokenizer, "_IN_PROCESS", {})
        tok = engine_tokenizer(path, None)
        assert not isinstance(tok, BackendTokenizer) and tok.clean_up_tokenization_spaces
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").iterdir())


def test_an_engine_whose_tokenizer_was_kept_imports_no_transformers(tiny_llama, smol_tokenizer, tmp_path,
                                                                     monkeypatch):
    """As a replica starts (its config pickled) on a machine where an engine ran its model before:
    no transformers in the process, and the text it streams is transformers' decode of its tokens;
    a simulated engine of that model (as a replica host runs them) imports not even torch. A changed
    tokenizer file is another entry (read by transformers again)."""
    from records.config_resolution import engine_config

    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    cache = tmp_path / "cache"
    monkeypatch.setenv("PDSERVE_TOKENIZER_CACHE", str(cache))
    assert not isinstance(engine_tokenizer(str(model), None), BackendTokenizer)  # (as the first engine: kept)
    assert len(list(cache.iterdir())) == 1
    cfg = tmp_path / "cfg.pkl"
    cfg.write_bytes(pickle.dumps(engine_config(str(model), dtype="float32", num_kv_blocks=64, max_model_len=256)))
    simulated = tmp_path / "simulated.pkl"
    simulated.write_bytes(pickle.dumps(engine_config(str(model), simulate=SIM_PROFILE, max_model_len=256)))
    code = (
        "import json, pickle, sys\n"
        "from engine.llm_engine import LLMEngine\n"
        "from engine.text.backend_tokenizer import BackendTokenizer\n"
        "from records.sampling_params import SamplingParams\n"
        "def run(path):\n"
        "    engine = LLMEngine(pickle.load(open(path, 'rb')))\n"
        "    engine.add_request('r', None, [1, 2, 3, 4, 5], SamplingParams(max_tokens=24, temperature=0.0, "
        "ignore_eos=True, logprobs=2))\n"
        "    text, ids = '', []\n"
        "    while engine.has_unfinished_requests():\n"
        "        for out in engine.step():\n"
        "            text, ids = out.outputs[0].text, out.outputs[0].token_ids\n"
        "    return {'kept': isinstance(engine.tokenizer, BackendTokenizer), 'text': text, 'ids': list(ids),\n"
        "            'torch': 'torch' in sys.modules, 'transformers': 'transformers' in sys.modules}\n"
        f"simulated = run({str(simulated)!r})\n"
        f"print(json.dumps([simulated, run({str(cfg)!r})]))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    simulated, out = json.loads(res.stdout.strip().splitlines()[-1])
    assert (simulated["kept"], simulated["torch"], simulated["transformers"], len(simulated["ids"])) == (
        True, False, False, 24)
    assert simulated["text"] == smol_tokenizer.decode(simulated["ids"], skip_special_tokens=True)
    assert (out["kept"], out["transformers"], len(out["ids"])) == (True, False, 24)
    assert out["text"] == smol_tokenizer.decode(out["ids"], skip_special_tokens=True)
    entry = backend_tokenizer._cache_file(str(model), None)
    config = model / "tokenizer_config.json"
    config.write_text(config.read_text() + "\n")       # changed (its size and mtime): another entry
    assert backend_tokenizer._cache_file(str(model), None) not in (entry, None)


def test_the_cache_keeps_only_the_newest_entries(smol_tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_TOKENIZER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(backend_tokenizer, "KEEP_ENTRIES", 1)
    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    smol_tokenizer.save_pretrained(first)
    smol_tokenizer.save_pretrained(second)
    for path in (first, second):
        assert not isinstance(engine_tokenizer(path, None), BackendTokenizer)
    assert len(list((tmp_path / "cache").iterdir())) == 1
    monkeypatch.setattr(backend_tokenizer, "_IN_PROCESS", {})
    assert isinstance(engine_tokenizer(second, None), BackendTokenizer)      # the newest, kept
    assert not isinstance(engine_tokenizer(first, None), BackendTokenizer)   # the oldest, dropped
