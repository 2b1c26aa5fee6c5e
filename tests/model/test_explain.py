"""Explain and steer (issue 13) on one tiny CDLM+Concept model trained on a planted corpus.

The corpus: six topic documents (one distinctive sentence each, repeated), one document
that holds a planted sentence exactly once, and a held-out validation document. One model
is trained per module (60 steps) and shared by every test here.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from model.attribution import (COMPLETENESS_BOUND, concept_contributions, explain_concepts, explain_inputs,
                               integrated_gradients)
from model.config import MASK_ID, ModelConfig, TrainConfig
from model.sampling import GenerationTrace, generate

TOPICS = [
    "Copper harbour lobster crab tide reef whale coral fisherman boat shell salt.",
    "Guitar melody album chorus drummer concert singer piano record tour stage song.",
    "Locomotive station freight carriage signal platform depot engine ticket rail track train.",
    "Regiment cannon siege fortress soldier battle navy general troops castle sword army.",
    "Orchard apple pear plum cherry blossom harvest basket ladder farmer cider barn.",
    "Glacier summit snow ridge climber rope ice peak valley avalanche tent storm.",
]
# a sentence of words found nowhere else, duplicated in one document (duplication is what
# makes a model memorise); with several copies its words become whole BPE tokens
PLANTED = "Zephyr quokka telescope obsidian marmalade juniper wombat sapphire kettle lantern."


def planted_docs() -> list[str]:
    docs = [f" = Topic {i} = \n" + " ".join([s] * 16) for i, s in enumerate(TOPICS)]
    orchard = TOPICS[4]
    docs.append(" = Planted = \n" + " ".join([orchard] * 6 + [PLANTED] * 3 + [orchard] * 6))
    docs.append(" = Held out = \n" + " ".join([TOPICS[0]] * 4))  # validation split (never indexed)
    return docs


@pytest.fixture(scope="module")
def trained():
    from model.loop import train

    mc = ModelConfig.preset("tiny", family="cdlm_concept", vocab_size=1024, max_seq_len=64, block_size=8)
    tc = TrainConfig(steps=60, batch_size=8, seq_len=32, chunk_len=16, lr=3e-3, warmup_steps=10, eval_batches=1,
                     val_fraction=0.1, seed=0, threads=2)
    res = train(mc, tc, planted_docs(), progress=False, device="cpu")
    return res.model.eval(), res.tokenizer, res.concept_names


def _generation(trained, text="Guitar melody album", n=16):
    model, tok, _ = trained
    prompt = torch.tensor(tok.encode(text).ids)
    trace = GenerationTrace()
    out = generate(model, prompt, n, steps_per_block=4, trace=trace)
    return prompt, out, trace


def test_trace_records_commit_snapshots_without_changing_generation(trained):
    model, _, _ = trained
    prompt, out, trace = _generation(trained)
    assert torch.equal(out, generate(model, prompt, 16, steps_per_block=4))  # default behaviour unchanged
    P = len(prompt)
    assert (trace.step[0, :P] == -1).all() and (trace.step[0, P:] >= 0).all()
    for p in range(P, out.shape[1]):
        snap, out_pos = trace.source(0, p)
        assert out_pos == p and snap[p] == MASK_ID  # still masked in the snapshot it was committed from
        assert torch.equal(snap[:P], prompt)
        with torch.no_grad():  # replaying the snapshot reproduces the committed choice (greedy)
            logits = model(snap[None])[0, p].float()
        logits[[0, MASK_ID]] = -float("inf")
        assert int(logits.argmax()) == int(out[0, p])


def test_integrated_gradients_completeness_within_bound(trained):
    model, _, _ = trained
    prompt, out, trace = _generation(trained, n=8)
    P = len(prompt)
    errs = []
    for p in range(P, out.shape[1], 2):
        ia = explain_inputs(model, trace, [p], out, steps=32)
        snap, _ = trace.source(0, p)
        masked = (snap == MASK_ID).nonzero().flatten()
        masked = masked[masked < len(ia.scores)]
        assert np.all(ia.scores[masked.numpy()] == 0)  # [MASK] inputs equal the baseline
        assert np.all(ia.scores[len(snap):] == 0)  # positions after the snapshot cannot matter
        errs.append(ia.check(COMPLETENESS_BOUND))
    group = explain_inputs(model, trace, list(range(P, out.shape[1])), out, steps=32)
    assert group.check(COMPLETENESS_BOUND) <= COMPLETENESS_BOUND and len(group.per_token_error) == out.shape[1] - P
    # refinement (doubling the steps of a token above the bound) never makes it worse
    refined = explain_inputs(model, trace, list(range(P, out.shape[1])), out, steps=8, refine_to=COMPLETENESS_BOUND)
    assert max(refined.per_token_error) <= COMPLETENESS_BOUND and refined.steps >= 8
    # the right Riemann sum with one step is input x gradient: same attribution mass sign, cruder
    snap, pos = trace.source(0, P)
    a1, fx, fb = integrated_gradients(model, snap, pos, int(out[0, P]), steps=1, method="riemann_right")
    a32, fx2, fb2 = integrated_gradients(model, snap, pos, int(out[0, P]), steps=32)
    assert fx == pytest.approx(fx2) and fb == pytest.approx(fb2)
    assert abs(a32.sum() - (fx - fb)) <= abs(a1.sum() - (fx - fb)) + 1e-6


def test_concept_attribution_sums_to_logit(trained):
    model, _, names = trained
    prompt, out, trace = _generation(trained)
    P = len(prompt)
    per_tok = explain_concepts(model, trace, list(range(P, out.shape[1])), out)
    for ca in per_tok:
        assert ca.verify(atol=1e-4) <= 1e-4
        assert len(ca.known) == model.cfg.topk_known and len(ca.unknown) == model.cfg.topk_unknown
    # the logit explained is the model's own logit in the commit snapshot
    snap, pos = trace.source(0, P)
    with torch.no_grad():
        assert per_tok[0].logit == pytest.approx(float(model(snap[None])[0, pos, int(out[0, P])]), abs=1e-4)
    # and it matches Steerling.decompose (known part and residual)
    dec = model.decompose(snap[None], positions=torch.tensor([[0, pos]]), tokens=out[0, P:P + 1])
    assert per_tok[0].known_total == pytest.approx(float(dec.known_total[0]), abs=1e-4)
    assert per_tok[0].residual == pytest.approx(float(dec.residual[0]), abs=1e-4)
    group = explain_concepts(model, trace, list(range(P, out.shape[1])), out, group=True)
    assert group.verify(atol=1e-3) <= 1e-3
    assert group.logit == pytest.approx(sum(c.logit for c in per_tok), abs=1e-4)
    top = group.top_known(3, names)
    assert len(top) == 3 and all(isinstance(n, str) and n for _, n, _ in top)
    # a corrupted decomposition is caught
    bad = concept_contributions(model, snap, [pos], [int(out[0, P])])[0]
    bad.residual += 0.01
    with pytest.raises(AssertionError, match="atol"):
        bad.verify(atol=1e-4)


def test_retrieval_returns_planted_chunk(trained, tmp_path, s3_server, s3_client):
    from atlas.config import StorageConfig
    from model.retrieval import TrainingDataIndex, build_and_save, load_for_model

    model, tok, _ = trained
    idx = build_and_save(model, tok, str(tmp_path / "model"), planted_docs(), chunk_len=24, val_fraction=0.1)
    chunks = idx.chunks.to_pylist()
    assert not any("Held out" in c["text"] for c in chunks)  # validation text is not indexed
    planted = {c["chunk_id"] for c in chunks if "quokka" in c["text"] or "sapphire" in c["text"]}
    assert 1 <= len(planted) <= 3
    # a memorised output: the planted sentence reproduced verbatim after some context
    ctx = tok.encode("Glacier summit snow ridge. ").ids
    span = tok.encode(" " + PLANTED).ids
    ids = torch.tensor(ctx + span)
    loaded = load_for_model(str(tmp_path / "model"))
    hits = loaded.search_span(model, ids, len(ctx), len(ids), k=3)
    assert hits[0].chunk_id in planted and hits[0].doc_id == "docs#6"  # the planted document
    assert hits[0].source and hits[0].text and hits[0].score > hits[-1].score - 1e-6
    # the text path agrees, and a generated span can also be pooled inside its sequence
    assert loaded.search_text(model, tok, PLANTED, k=1)[0].chunk_id in planted
    prompt, out, _ = _generation(trained)
    assert len(loaded.search_span(model, out[0], len(prompt), out.shape[1], k=2, in_context=True)) == 2
    # stored on S3 (moto) through pyarrow.fs and read back identically
    s3_client.create_bucket(Bucket="explain-idx")
    cfg = StorageConfig(s3_endpoint=s3_server)
    idx.save("s3://explain-idx/model/retrieval", cfg)
    back = TrainingDataIndex.load("s3://explain-idx/model/retrieval", cfg)
    assert back.chunks.equals(idx.chunks)
    assert [h.chunk_id for h in back.search_span(model, ids, len(ctx), len(ids), k=3)] == [h.chunk_id for h in hits]
    with pytest.raises(FileNotFoundError, match="meta.json"):
        TrainingDataIndex.load(str(tmp_path / "nowhere"))


def test_steering_in_logit_units_and_direction(trained):
    from model.steering import make_steering, random_steering, steered_generate

    model, tok, names = trained
    prompt = torch.tensor(tok.encode("Guitar melody album").ids)
    P = len(prompt)
    x = torch.cat([prompt, torch.full((8,), MASK_ID)])[None]
    name = next(n for n in names if n)
    amp = make_steering(model, {name: 5.0}, names)
    with torch.no_grad():
        base, steered = model(x), model(x, steer=amp(x))
    d = steered - base
    assert torch.allclose(d[0, P:].amax(-1), torch.full((8,), 5.0), atol=1e-3)  # exact at the last layer
    assert d[0, :P].abs().max() == 0  # only still-masked positions are steered
    sup = make_steering(model, {name: -5.0}, names)
    with torch.no_grad():
        assert torch.allclose((model(x, steer=sup(x)) - base)[0, P:].amin(-1), torch.full((8,), -5.0), atol=1e-3)
    # by id and by name give the same direction; unknown names are refused with a hint
    assert torch.allclose(make_steering(model, {names.index(name): 5.0}).delta, amp.delta)
    with pytest.raises(KeyError, match="no known concept"):
        make_steering(model, {"no-such-concept": 1.0}, names)
    # a strong amplification makes the concept's top tokens dominate the generated text
    top_tok = int((model.lm_weight.float() @ amp.delta).argmax())
    out = steered_generate(model, prompt, 8, amp.scaled(8.0), steps_per_block=4)
    assert (out[0, P:] == top_tok).float().mean() >= 0.5
    # earlier-layer injection and the random control run, and the control has the same norm
    mid = make_steering(model, {name: 5.0}, names, layer=1)
    assert steered_generate(model, prompt, 8, mid, steps_per_block=4).shape == out.shape
    rnd = random_steering(model, amp)
    assert float(rnd.delta.norm()) == pytest.approx(float(amp.delta.norm()), rel=1e-5)


def test_ar_steering_hits_only_the_next_position():
    from model.modeling import Steerling
    from model.steering import make_steering

    torch.manual_seed(0)
    model = Steerling(ModelConfig.preset("tiny", family="ar_concept", vocab_size=512)).eval()
    st = make_steering(model, {3: 2.0})
    x = torch.randint(5, 500, (1, 10))
    with torch.no_grad():
        d = model(x, steer=st(x)) - model(x)
    assert d[0, :-1].abs().max() == 0 and float(d[0, -1].max()) == pytest.approx(2.0, abs=1e-4)


@pytest.mark.slow  # launches a browser
def test_cli_explain_and_steer_reports_render_in_chromium(trained, tmp_path, capsys):
    import shutil

    from atlas.cli import main
    from model.io import save_pretrained

    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(chromium).exists():
        pytest.skip("chromium is not installed (scripts/setup.sh installs it with apt-get)")
    pw = pytest.importorskip("playwright.sync_api")
    model, tok, names = trained
    mdir = tmp_path / "model"
    save_pretrained(model, mdir, tok, names)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(planted_docs()), encoding="utf-8")
    out = tmp_path / "explain.html"
    assert main(["explain", str(mdir), "Guitar melody album", "--max-new-tokens", "8", "--steps-per-block", "4",
                 "--corpus", str(corpus), "--chunk-len", "16", "--out", str(out), "--threads", "2"]) == 0
    printed = capsys.readouterr().out
    assert "generated:" in printed and "report:" in printed and (mdir / "retrieval" / "index.faiss").exists()
    page_html = out.read_text()
    assert "http://" not in page_html and "https://" not in page_html  # self-contained: no external assets
    name = next(n for n in names if n)
    steer_out = tmp_path / "steer.html"
    assert main(["steer", str(mdir), "Guitar melody album", "--concept", f"{name}=6", "--max-new-tokens", "8",
                 "--steps-per-block", "4", "--out", str(steer_out)]) == 0
    assert "unsteered:" in capsys.readouterr().out
    assert main(["steer", str(mdir), "x", "--concept", "nonexistent=2", "--out", str(steer_out)]) == 2

    with pw.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
        page = browser.new_page()
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(out.as_uri())
        assert page.title() == "Steerling explanation"
        assert page.inner_text("#selection") == "all generated tokens"
        assert page.locator("#heat .tok").count() == len(tok.encode("Guitar melody album").ids) + 8
        # the heat map is coloured by the JS from the embedded data, and concept bars are drawn
        assert page.locator("#heat .tok[title^='attribution']").count() > 0
        assert page.locator("#concepts .bar").count() >= 2 and "residual" in page.inner_text("#concepts")
        assert "corpus#" in page.inner_text("#retrieval")  # doc ids are <file stem>#<article>
        page.locator(".gen").first.click()
        assert page.inner_text("#selection").startswith("token 1:")
        page.goto(steer_out.as_uri())
        assert page.title() == "Steerling steering report" and name in page.inner_text("body")
        assert page.inner_text("#steered") and page.inner_text("#unsteered")
        browser.close()
    assert not errors, errors


def test_atlas_chunk_tables_feed_the_index():
    import pyarrow as pa

    from atlas.schemas import CHUNKS
    from model.retrieval import CHUNK_SCHEMA, atlas_chunks

    chunks = pa.table({"chunk_id": ["b-00001", "a-00000"], "doc_id": ["b", "a"], "chunk_index": [1, 0],
                       "text": ["two", "one"], "n_tokens": [1, 1], "char_start": [3, 0], "char_end": [6, 3]},
                      schema=CHUNKS)
    docs = pa.table({"doc_id": ["a", "b"], "source": ["s3://c/a.txt", "s3://c/b.txt"]})
    t = atlas_chunks(chunks, docs)
    assert t.schema == CHUNK_SCHEMA
    assert t.to_pylist() == [{"chunk_id": "a-00000", "doc_id": "a", "source": "s3://c/a.txt", "text": "one"},
                             {"chunk_id": "b-00001", "doc_id": "b", "source": "s3://c/b.txt", "text": "two"}]
