"""One explanation of a generation, and its self-contained HTML report.

``explain`` generates from a prompt (optionally steered), then attributes every generated
token three ways: input tokens (IG replayed on the commit snapshot), concepts (exact logit
decomposition) and training data (FAISS retrieval, when an index exists). ``render_html``
writes one HTML file with inline CSS/JS and the data embedded as JSON: no external assets,
so the report opens from disk or an artifact store in any browser.
"""

from __future__ import annotations

import html
import json
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from model.attribution import COMPLETENESS_BOUND, DEFAULT_IG_STEPS, InputAttribution, explain_concepts, explain_inputs
from model.sampling import GenerationTrace
from model.steering import Steering, steered_generate


@dataclass
class Explanation:
    prompt: str
    text: str  # generated continuation
    pieces: list[str]  # decoded token pieces of prompt + generation
    prompt_len: int
    ig_steps: int
    ig_group: list[float]  # IG over input positions for the whole generation
    ig_tokens: list[list[float]]  # per generated token
    ig_errors: list[float]  # per-token completeness error
    ig_token_steps: list[int]  # IG steps used per token (more than ig_steps only when refined)
    ig_group_error: float
    concepts_group: dict
    concepts_tokens: list[dict]
    retrieval: list[dict] = field(default_factory=list)
    steering: dict | None = None
    unsteered_text: str | None = None
    model: str = ""
    seconds: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def _concepts_dict(ca, names, top: int) -> dict:
    return {"logit": ca.logit, "known_total": ca.known_total, "unknown_total": ca.unknown_total,
            "residual": ca.residual, "error": ca.error(),
            "known": [{"id": i, "name": n, "value": v} for i, n, v in ca.top_known(top, names)],
            "unknown": [{"id": i, "name": n, "value": v} for i, n, v in ca.top_unknown(top)]}


def explain(model, tokenizer, prompt: str, names: list[str] | None = None, max_new_tokens: int = 32,
            steps_per_block: int | None = None, ig_steps: int = DEFAULT_IG_STEPS, top: int = 5, index=None, k: int = 5,
            steering: Steering | None = None, model_name: str = "",
            ig_refine_to: float | None = COMPLETENESS_BOUND) -> Explanation:
    """Generate (greedy) and explain every generated token; see the module docstring.

    ``ig_refine_to``: a token whose IG completeness error exceeds this after ``ig_steps``
    steps is recomputed with doubled steps (up to 256); sharp logit transitions along the
    path (trained attention switching) can need 64-128 steps. None keeps ``ig_steps``.
    """
    t0 = time.perf_counter()
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    if not ids:
        raise ValueError("empty prompt")
    prompt_ids = torch.tensor(ids)
    kw = {"steps_per_block": steps_per_block} if model.cfg.is_diffusion else {}
    unsteered = None
    if steering is not None:
        base = steered_generate(model, prompt_ids, max_new_tokens, None, **kw)
        unsteered = tokenizer.decode(base[0, len(ids):].tolist())
    trace = GenerationTrace()
    out = steered_generate(model, prompt_ids, max_new_tokens, steering, trace=trace, **kw)
    seq = out[0]
    P, T = len(ids), seq.shape[0]
    gen = list(range(P, T))
    per_ig = [explain_inputs(model, trace, [p], seq, ig_steps, refine_to=ig_refine_to) for p in gen]
    group_scores = np.sum([a.scores for a in per_ig], axis=0)
    group_delta = sum(a.delta for a in per_ig)
    group_ig = InputAttribution(gen, [int(seq[p]) for p in gen], group_scores, group_delta, ig_steps)
    concepts = []
    group_c = None
    if model.concept is not None:
        per_c = explain_concepts(model, trace, gen, seq)
        for c in per_c:
            c.verify(atol=1e-3)
        group_c = explain_concepts(model, trace, gen, seq, group=True)
        group_c.verify(atol=1e-2)  # sums of T fp32 terms
        concepts = [_concepts_dict(c, names, top) for c in per_c]
    hits = []
    if index is not None:
        hits = [asdict(h) for h in index.search_span(model, seq, P, T, k)]
    return Explanation(
        prompt=prompt, text=tokenizer.decode(seq[P:].tolist()),
        pieces=[tokenizer.decode([int(t)]) for t in seq.tolist()], prompt_len=P, ig_steps=ig_steps,
        ig_group=group_ig.scores.tolist(), ig_tokens=[a.scores.tolist() for a in per_ig],
        ig_errors=[float(a.per_token_error[0]) for a in per_ig], ig_token_steps=[a.steps for a in per_ig],
        ig_group_error=group_ig.completeness_error,
        concepts_group=_concepts_dict(group_c, names, top) if group_c is not None else {},
        concepts_tokens=concepts, retrieval=hits,
        steering=({"layer": steering.layer, "groups": steering.groups} if steering is not None else None),
        unsteered_text=unsteered, model=model_name, seconds=time.perf_counter() - t0)


# ----------------------------------------------------------------------------- HTML
_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:24px;max-width:1100px;color:#222}
h1{font-size:20px}h2{font-size:16px;margin-top:28px;border-bottom:1px solid #ddd}
.tok{padding:1px 0;border-radius:3px;white-space:pre-wrap;font-family:ui-monospace,monospace;font-size:14px}
.gen{cursor:pointer;outline:1px dotted #999}.gen.sel{outline:2px solid #000}
.heat{line-height:1.9;border:1px solid #eee;padding:10px}
.bar{display:flex;align-items:center;margin:2px 0;font-size:13px}
.bar .lab{width:220px;overflow:hidden;text-overflow:ellipsis;white-space:nowrap}
.bar .fill{height:14px;margin-right:6px}.pos{background:#d6604d}.neg{background:#4393c3}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ddd;padding:4px 6px;vertical-align:top}
.muted{color:#777;font-size:12px}
"""

_JS = """
const D = JSON.parse(document.getElementById('data').textContent);
function colour(v, m){ if(!m) return 'transparent'; const a=Math.min(1,Math.abs(v)/m)*0.85;
  return v>=0 ? `rgba(214,96,77,${a})` : `rgba(67,147,195,${a})`; }
function showHeat(scores, label){
  const m = Math.max(...scores.map(Math.abs), 1e-9);
  document.querySelectorAll('#heat .tok').forEach((el,i)=>{
    const v = i < scores.length ? scores[i] : 0; el.style.background = colour(v, m);
    el.title = 'attribution ' + v.toFixed(4); });
  document.getElementById('selection').textContent = label;
}
function bars(id, c){
  const box = document.getElementById(id); box.innerHTML = '';
  if(!c || !c.known){ box.textContent = 'no concept module'; return; }
  const rows = [...c.known.map(r=>['known: '+r.name, r.value]), ...c.unknown.map(r=>[r.name, r.value]),
                ['residual (eps)', c.residual]];
  const m = Math.max(...rows.map(r=>Math.abs(r[1])), 1e-9);
  for(const [name, v] of rows){
    const d = document.createElement('div'); d.className='bar';
    d.innerHTML = `<span class="lab"></span><span class="fill ${v>=0?'pos':'neg'}"></span><span class="val"></span>`;
    d.querySelector('.lab').textContent = name; d.querySelector('.fill').style.width = (Math.abs(v)/m*300)+'px';
    d.querySelector('.val').textContent = v.toFixed(3); box.appendChild(d); }
  const s = document.createElement('div'); s.className='muted';
  s.textContent = `logit ${c.logit.toFixed(3)} = known ${c.known_total.toFixed(3)} + unknown ${c.unknown_total.toFixed(3)} + residual ${c.residual.toFixed(3)} (gap ${c.error.toExponential(1)})`;
  box.appendChild(s);
}
function select(j){
  document.querySelectorAll('.gen').forEach(e=>e.classList.remove('sel'));
  if(j===null){ showHeat(D.ig_group, 'all generated tokens'); bars('concepts', D.concepts_group); return; }
  document.querySelector(`.gen[data-j="${j}"]`).classList.add('sel');
  showHeat(D.ig_tokens[j], `token ${j+1}: "${D.pieces[D.prompt_len+j]}" (completeness error ${(100*D.ig_errors[j]).toFixed(2)}%, ${D.ig_token_steps[j]} steps)`);
  bars('concepts', D.concepts_tokens[j]);
}
document.querySelectorAll('.gen').forEach(e=>e.addEventListener('click', ()=>select(+e.dataset.j)));
document.getElementById('all').addEventListener('click', ()=>select(null));
select(null);
"""


def render_html(ex: Explanation, title: str = "Steerling explanation") -> str:
    esc = html.escape
    toks = []
    for i, piece in enumerate(ex.pieces):
        if i < ex.prompt_len:
            toks.append(f'<span class="tok">{esc(piece)}</span>')
        else:
            toks.append(f'<span class="tok gen" data-j="{i - ex.prompt_len}">{esc(piece)}</span>')
    steer = ""
    if ex.steering:
        groups = "; ".join(f"{', '.join(g['concepts'])} at {g['strength']:+g} logits (alpha {g['alpha']:.3g})"
                           for g in ex.steering["groups"])
        steer = (f"<h2>Steering</h2><p>{esc(groups)}, injected at layers &ge; {ex.steering['layer']}</p>"
                 f"<p><b>unsteered:</b> <span id='unsteered'>{esc(ex.unsteered_text or '')}</span></p>"
                 f"<p><b>steered:</b> <span id='steered'>{esc(ex.text)}</span></p>")
    if ex.retrieval:
        rows = "".join(f"<tr><td>{h['rank']}</td><td>{h['score']:.3f}</td><td>{esc(h['doc_id'])}</td>"
                       f"<td>{esc(h['source'])}</td><td>{esc(h['text'])}</td></tr>" for h in ex.retrieval)
        retr = ("<table id='retrieval'><tr><th>#</th><th>cosine</th><th>doc</th><th>source</th><th>chunk</th></tr>"
                f"{rows}</table><p class='muted'>similarity in the model's representation space (mean-pooled "
                "hidden states), an approximation, not a causal influence estimate</p>")
    else:
        retr = "<p id='retrieval'>no training-data index beside this model</p>"
    worst = max(ex.ig_errors) if ex.ig_errors else 0.0
    data = json.dumps(asdict(ex)).replace("</", "<\\/")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title><style>{_CSS}</style></head>
<body>
<h1>{esc(title)}</h1>
<p class="muted">model {esc(ex.model)} &middot; {len(ex.pieces) - ex.prompt_len} generated tokens &middot;
IG {ex.ig_steps} steps (Gauss-Legendre; up to {max(ex.ig_token_steps, default=ex.ig_steps)} where refined)
from an all-[MASK] baseline, replayed on each token's commit snapshot &middot;
completeness error: whole generation {100 * ex.ig_group_error:.2f}%, worst token {100 * worst:.2f}%
(bound {100 * COMPLETENESS_BOUND:.0f}%) &middot; {ex.seconds:.1f} s</p>
<p><b>prompt:</b> {esc(ex.prompt)}<br><b>generated:</b> <span id="generated">{esc(ex.text)}</span></p>
{steer}
<h2>Input attribution</h2>
<p>Showing: <span id="selection"></span> <button id="all">whole generation</button>
<span class="muted">click a generated (dotted) token to explain it alone; red raises its logit, blue lowers it</span></p>
<div id="heat" class="heat">{''.join(toks)}</div>
<h2>Concept attribution</h2>
<div id="concepts"></div>
<h2>Training data</h2>
{retr}
<script type="application/json" id="data">{data}</script>
<script>{_JS}</script>
</body></html>
"""


def write_report(ex: Explanation, path: str, title: str = "Steerling explanation") -> str:
    from pathlib import Path

    Path(path).write_text(render_html(ex, title), encoding="utf-8")
    return str(path)
