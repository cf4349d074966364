"""Tests of the committed built-in models: `models/tiny-shakespeare{,-draft,-moe,-eagle}/`.

What this is: checks that the two checkpoints made by `models/train_tiny.py` are
what the rest of the project relies on: they load through Hugging Face and
through our own loader with the same logits, the byte-level tokenizer
round-trips any text, the target writes recognisable Shakespeare (real words,
speaker lines), and the draft is cheap and agrees with the target often enough
for speculative decoding (level 4) to pay; the EAGLE head (`models/train_eagle.py`)
trains reproducibly and drafts the target's tokens more often than the draft does.

What this is not: a retraining test (training takes most of an hour), nor a
benchmark. Thresholds sit well below the measured values in `models/README.md`
so that a shared, noisy CPU cannot flip them, but far above what an untrained
or a mis-loaded model scores, so each test can fail.

Reference: `models/README.md` (the measured numbers and the commands).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ladder.models import train_eagle_module, train_tiny_module

pytestmark = pytest.mark.models

REPO = Path(__file__).resolve().parent.parent
TARGET = REPO / "models" / "tiny-shakespeare"
DRAFT = REPO / "models" / "tiny-shakespeare-draft"
MOE = REPO / "models" / "tiny-shakespeare-moe"
CORPUS = REPO.parent / "shared" / "corpus" / "tinyshakespeare.txt"  # beside the clone in CI; may be absent

# From the held-out last 10 % of the corpus (the models never trained on it).
HELD_OUT = (
    "TRANIO:\nIs't possible, friend Licio, that Mistress Bianca\nDoth fancy any other but Lucentio?\n"
    "I tell you, sir, she bears me fair in hand.\n\nHORTENSIO:\nSir, to satisfy you in what I have said,\n"
    "Stand by and mark the manner of his teaching.\n\nLUCENTIO:\nNow, mistress, profit you in what you read?\n\n"
    "BIANCA:\nWhat, master, read you? first resolve me that.\n\nLUCENTIO:\nI read that I profess, the Art to "
    "Love.\n\nBIANCA:\nAnd may you prove, sir, master of your art!\n\nLUCENTIO:\nWhile you, sweet dear, prove "
    "mistress of my heart!\n\nHORTENSIO:\nQuick proceeders, marry! Now, tell me, I pray,\nYou that durst swear "
    "at your mistress Bianca\nLoved none in the world so well as Lucentio.\n\nTRANIO:\nO despiteful love! "
    "unconstant womankind!\nI tell thee, Licio, this is wonderful.\n\nHORTENSIO:\nMistake no more: I am not "
    "Licio,\nNor a musician, as I seem to be;\nBut one that scorn to live in this disguise,\n"
)

# The corpus's 500 most frequent words: the fallback word list when the corpus
# itself is not beside the clone. They cover ~75 % of the corpus's words.
COMMON_WORDS = set(
    """
a about after again against ah alas all am an and angelo anne another answer any are arms art as
at aufidius aumerle autolycus away ay back baptista be bear because bed been before being
believe benvolio beseech best better bianca bid biondello blood bloody body bolingbroke born
both boy break breath bring brother brutus buckingham business but by call came camillo can
cannot capulet care catesby cause child children citizen city clarence claudio clifford clown
come comes comfort cominius content coriolanus could cousin crown daughter day days dead dear
death did die do does done dost doth doubt down duchess duke ears earth edward either elizabeth
else end enough ere escalus even ever every eye eyes face fair faith fall false far farewell
father father's fear fellow fight find fire first follow for forth fortune foul friar friend
friends from full gaunt gentle gentleman gentlemen get give gloucester go god gods gone good
grace gracious grave great gremio grief grumio had hand hands happy has hast haste hastings hate
hath have he he's head hear heard heart heaven heavy help hence henry her here here's high him
himself his hither hold holy home honour hope horse hortensio hour house how husband i i'll if
ii iii ill in indeed into is isabella it iv john joy juliet justice kate katharina keep kind
king know lady land last laurence law lay leave left leontes less let let's lie lies life light
like little live lives long look looks lord lords lost love lucentio lucio madam made maid
majesty make makes man many marcius margaret marry master matter may me mean means meet men
menenius mercutio mercy messenger might mind mine mistress montague more morrow most mother much
murderer must my myself name nature nay ne'er need never new news night no noble none nor
northumberland not nothing now nurse o o'er of off old on once one only or other our out own
pardon paris part paulina peace people petruchio pity place play please polixenes pompey poor
power pray present prince prospero proud prove provost put queen rather rest richard right rome
romeo royal said save saw say sea second see seen send servant servingman set shall shalt shame
she shepherd should show sicinius since sir sister sit sleep so some son sorrow soul sound
sovereign speak stand state stay still such sun swear sweet sword take talk tears tell than
thank that that's the thee their them then there there's therefore these they thine thing things
think third this those thou though thought thousand three through thus thy thyself till time
times tis to together told tongue too tranio true truth turn twas two tybalt uncle under unto up
upon us use very vi villain vincentio volumnia war warwick was way we we'll welcome well were
what what's when where which while who whom whose why wife will wilt wish with within without
woe woman word words world worthy would wrong years yet york you young your yours yourself
""".split()
)

WORD = re.compile(r"[a-z]+(?:'[a-z]+)?")
SPEAKER_LINE = re.compile(r"^[A-Z][A-Z' ]*[A-Z]:$", re.MULTILINE)  # "ROMEO:", "KING RICHARD III:"


def train_tiny():
    """`models/train_tiny.py` is a script, not a package: the demos' helper imports it by path."""
    return train_tiny_module()


def word_list() -> set[str]:
    if CORPUS.is_file():
        return set(WORD.findall(CORPUS.read_text().lower()))
    return COMMON_WORDS


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TARGET)


@pytest.fixture(scope="module")
def target():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def draft():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(DRAFT, dtype=torch.float32).eval()


def held_out_ids(tokenizer) -> torch.Tensor:
    return torch.tensor([tokenizer.encode(HELD_OUT)])  # [1, T]


# ---------------------------------------------------------------------------
# The files.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", [TARGET, DRAFT], ids=["target", "draft"])
def test_checkpoint_files_and_config(path):
    for name in (
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    ):
        assert (path / name).is_file(), f"{path.name} lacks {name}"
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["vocab_size"] == 259
    assert cfg["max_position_embeddings"] >= 1024
    assert cfg["dtype"] in ("bfloat16", "float16")
    gen = json.loads((path / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (256, 257)


@pytest.mark.parametrize("name", ["tiny-shakespeare", "tiny-shakespeare-draft"])
def test_the_default_context_is_the_training_window(name):
    """The models were trained on 256-byte windows (train_tiny's block_size): an engine, and so
    a server's /v1/models, defaults to that, not to the 2048 positions the checkpoint has;
    -1 asks for every position, any other length up to them is honoured."""
    from level0_naive import LLM

    window = train_tiny_module().PRESETS["draft" if name.endswith("draft") else "target"].block_size
    assert window == 256
    assert LLM(name, kv_cache_memory=1).llm_engine.max_model_len == window
    assert LLM(name, kv_cache_memory=1, max_model_len=-1).llm_engine.max_model_len == 2048
    assert LLM(name, kv_cache_memory=1, max_model_len=1000).llm_engine.max_model_len == 1000


def test_sizes_flops_and_gqa():
    from transformers import AutoConfig

    total = sum(f.stat().st_size for d in (TARGET, DRAFT) for f in d.iterdir())
    assert total <= 30 * 2**20, f"checkpoints take {total / 2**20:.1f} MiB, budget 30"
    t, d = AutoConfig.from_pretrained(TARGET), AutoConfig.from_pretrained(DRAFT)
    assert t.num_key_value_heads < t.num_attention_heads  # the built-in model exercises GQA
    flops = train_tiny().matmul_flops_per_token
    for context in (1, 256, 1024, t.max_position_embeddings):
        ratio = flops(d, context)["total"] / flops(t, context)["total"]
        assert ratio <= 1 / 8, f"draft costs {ratio:.3f} of the target at context {context}"


# ---------------------------------------------------------------------------
# The tokenizer.
# ---------------------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(text=st.text())
def test_tokenizer_round_trips_any_text(tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    if not any(s in text for s in ("<bos>", "<eos>", "<pad>")):
        assert ids == list(text.encode("utf-8"))  # token id = byte value, and no BOS added


def test_tokenizer_specials_and_tricky_text(tokenizer):
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (256, 257, 258)
    assert len(tokenizer) == 259
    for text in ("a , b . c", "  two  spaces\n\n\ttab\r\n", "emoji 😀 中文 \x00\x01\x7f", "ROMEO:\n"):
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.decode([256, 104, 105, 257], skip_special_tokens=True) == "hi"


def test_chat_template(tokenizer):
    messages = [{"role": "user", "content": "Speak, friend."}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "USER:\nSpeak, friend.\n\nASSISTANT:\n"
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert ids == list(text.encode())


# ---------------------------------------------------------------------------
# The models' quality.
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def romeo(tokenizer, target):
    """The target's greedy 200 bytes after "ROMEO:\n": (prompt length, ids [1, P + 200])."""
    ids = torch.tensor([tokenizer.encode("ROMEO:\n")])  # [1, P]
    with torch.no_grad():
        out = target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=200,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    return ids.shape[1], out


@torch.no_grad()
def test_held_out_loss(tokenizer, target, draft):
    """Measured on this passage (read cold, no earlier context): target 1.54, draft
    1.99 nats/byte; a random model scores ~5.5 (ln 259 = 5.56)."""
    ids = held_out_ids(tokenizer)
    losses = {name: m(input_ids=ids, labels=ids).loss.item() for name, m in (("target", target), ("draft", draft))}
    assert losses["target"] < 1.8, losses
    assert losses["draft"] < 2.3, losses
    assert losses["target"] < losses["draft"], losses


def test_target_writes_shakespeare(tokenizer, romeo):
    """Measured: 41 words, all in the corpus (90 % in the fallback list), a
    "CLARENCE:" speaker line; an untrained model writes no words at all."""
    prompt_len, out = romeo
    text = tokenizer.decode(out[0, prompt_len:])
    words = WORD.findall(text.lower())
    known = word_list()
    frac = sum(w in known for w in words) / max(1, len(words))
    assert len(words) >= 25, text
    assert frac >= 0.7, f"{frac:.2f} of words known in:\n{text}"
    assert SPEAKER_LINE.search(text), f"no speaker line in:\n{text}"


@torch.no_grad()
def test_draft_agrees_with_target(tokenizer, target, draft, romeo):
    """Greedy agreement, two ways (README: the measurement over the whole split).

    On the target's own greedy text (the acceptance rate of greedy speculative
    decoding): measured 0.745. Teacher-forced on the held-out passage:
    measured 0.566. An untrained draft agrees almost never."""
    prompt_len, out = romeo
    proposed = draft(input_ids=out[:, :-1]).logits.argmax(-1)[:, prompt_len - 1 :]  # [1, 200]
    on_greedy = (proposed == out[:, prompt_len:]).float().mean().item()
    assert on_greedy >= 0.6, on_greedy

    ids = held_out_ids(tokenizer)
    a = target(input_ids=ids).logits.argmax(-1)  # [1, T]
    b = draft(input_ids=ids).logits.argmax(-1)  # [1, T]
    teacher_forced = (a == b).float().mean().item()
    assert teacher_forced >= 0.45, teacher_forced


# ---------------------------------------------------------------------------
# Our own loader (written last: its API was settling while these models trained).
# ---------------------------------------------------------------------------


@torch.no_grad()
@pytest.mark.parametrize("path", [TARGET, DRAFT, MOE], ids=["target", "draft", "moe"])
def test_project_loader_matches_transformers(path, tokenizer):
    from transformers import AutoModelForCausalLM

    from level0_naive.kv_cache import Slab, SlabAttention
    from level0_naive.loader import load_model

    ids = held_out_ids(tokenizer)[0, :200]  # [T]
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager").eval()
    expected = ref(input_ids=ids[None]).logits[0]  # [T, V]

    loaded = load_model(path, dtype=torch.float32, device="cpu")  # bf16 on disk, upcast
    assert loaded.tokenizer is not None and loaded.tokenizer.encode("ROMEO:") == list(b"ROMEO:")
    # One prefill of the same tokens through level 0's own cache backend.
    attn = SlabAttention([Slab(loaded.config, len(ids), torch.float32, "cpu")], torch.tensor([0, len(ids)]))
    hidden = loaded.model(ids, torch.arange(len(ids)), attn)  # [T, hidden]
    logits = loaded.model.compute_logits(hidden)  # [T, V]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_the_mixture_writes_words_and_uses_every_expert(tokenizer):
    """On the held-out passage's first 256 bytes (its training window: unlike the dense target it
    does not extrapolate past it, 2.69 nats/byte over the whole passage): cross-entropy measured
    1.33; no expert takes more than 35 % of a layer's slots and at least 7 of 8 are used in every
    layer (the load-balancing loss at work; layer 3's expert 6 gets none of this passage). An
    untrained mixture scores ~5.5 and writes no words; a collapsed router sends nearly everything
    to one or two experts."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    moe = AutoModelForCausalLM.from_pretrained(MOE, dtype=torch.float32, experts_implementation="eager").eval()
    ids = held_out_ids(tokenizer)[:, :256]
    logits = moe(input_ids=ids).logits[0]  # [256, V]
    assert F.cross_entropy(logits[:-1], ids[0, 1:]).item() < 2.0
    out = moe.generate(tokenizer("ROMEO:\n", return_tensors="pt").input_ids, max_new_tokens=120, do_sample=False,
                       pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    words = WORD.findall(tokenizer.decode(out[0, 7:]).lower())
    assert len(words) >= 12 and sum(w in word_list() for w in words) / len(words) >= 0.7, words
    from level0_naive.kv_cache import Slab, SlabAttention
    from level0_naive.loader import load_model

    loaded = load_model(MOE, torch.float32)
    n = ids.shape[1]
    loaded.model(ids[0], torch.arange(n), SlabAttention([Slab(loaded.config, n, torch.float32, "cpu")],
                                                         torch.tensor([0, n])))  # fmt: skip
    for layer in loaded.model.model.layers:
        share = torch.bincount(layer.mlp.last_ids.flatten(), minlength=8) / layer.mlp.last_ids.numel()
        assert share.max() <= 0.45 and (share > 0).sum() >= 6, share


# ---------------------------------------------------------------------------
# The EAGLE head (models/train_eagle.py), over the target.
# ---------------------------------------------------------------------------
EAGLE = REPO / "models" / "tiny-shakespeare-eagle"


def test_eagle_training_is_reproducible(tmp_path):
    """Same seed, same weights, bit for bit (three steps of 2 x 32 bytes over the real target); another seed, others."""
    import argparse

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(HELD_OUT * 4)
    te = train_eagle_module()

    def weights(seed: int) -> dict:
        args = argparse.Namespace(seed=seed, target=str(TARGET), corpus=str(corpus), lr=2e-3, steps=3, batch_size=2,
                                  block=32, log_every=10)  # fmt: skip
        return te.train(args)["head"].state_dict()

    a, b, c = weights(1), weights(1), weights(2)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if "rotary" not in k)


def test_the_eagle_head_is_what_its_card_says():
    cfg = json.loads((EAGLE / "config.json").read_text())
    target_cfg = json.loads((TARGET / "config.json").read_text())
    assert cfg["architectures"] == ["EagleLlamaForCausalLM"] and cfg["num_hidden_layers"] == 1
    assert cfg["eagle"]["target"] == "tiny-shakespeare" and cfg["hidden_size"] == target_cfg["hidden_size"]
    log = json.loads((EAGLE / "train_log.json").read_text())
    assert log["parameters"] == 1_114_880  # fc (2H x H) + one layer + a norm; the embeddings and LM head are the target's
    first = log["acceptance"]["acceptance_by_position"][0]
    assert 0.5 < first <= 1, first


@torch.no_grad()
def test_the_committed_eagle_head_drafts_what_the_target_writes(target, draft, romeo):
    """On the target's greedy text after "ROMEO:\\n" (not the card's held-out prompts, so thresholds with a margin):
    the head's first draft is the target's next token more often than the draft model's is, and it keeps some of
    that over a chain of its own features; a head that ignores what it reads agrees almost never (checked: the
    same head with its fc zeroed). Measured: the head's first draft 0.789 right (then 0.769, 0.725 along its
    chain: 2.84 tokens a step with 3 drafts), the draft model's 0.749, the zeroed head's 0.0."""
    te = train_eagle_module()
    head = te.load_head(EAGLE, target)
    prompt_len, out = romeo
    got = te.acceptance_on(target, head, out, prompt_len, k=3)
    first = got["acceptance_by_position"][0]
    proposed = draft(input_ids=out[:, :-1]).logits.argmax(-1)[:, prompt_len:]  # the draft model, same positions
    draft_rate = (proposed == out[:, prompt_len + 1 :]).float().mean().item()
    assert first >= 0.6 and first > draft_rate, (got, draft_rate)
    assert got["tokens_per_step_k1_to_k"][2] > 1 + first  # a second and third draft add something
    for p in head.fc.parameters():
        p.zero_()
    assert te.acceptance_on(target, head, out, prompt_len, k=1)["acceptance_by_position"][0] < 0.3
