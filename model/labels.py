"""STAND-IN chunk labeller — NOT the Atlas concept labels.

Until Atlas produces concept-labelled shards, experiments need chunk-level known-concept
labels. This labeller derives a small concept library from the corpus itself with two
transparent rules, and labels a chunk with every concept whose rule fires:

* keyword concepts  "kw:<word>": frequent content words (document frequency within a
  band); a chunk has the concept if the word occurs in its text.
* section concepts  "section:<heading>": frequent Wikipedia-style section headings
  ("= = History = ="); a chunk has the concept if it lies in such a section.

Replace with Atlas labels (same interface: names + label(text, section) -> ids) once the
shards exist.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

_WORD = re.compile(r"[a-z]{4,}")
_STOP = frozenset("""
about above after again against also among another around because been before being below
between both called came could does doing down during each early either even every first
following from further have having here however into itself just known large later least
less like made main many more most much must near never next only other over part same
several should since some such than that their them then there these they this those
though three through thus time under until upon very were what when where which while
whom whose will with within without would year years your unk
""".split())


@dataclass
class StandInLabeller:
    names: list[str]
    _kw: dict[str, int] = field(default_factory=dict, repr=False)
    _sec: dict[str, int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for i, name in enumerate(self.names):
            kind, _, key = name.partition(":")
            (self._kw if kind == "kw" else self._sec)[key] = i

    @property
    def n_concepts(self) -> int:
        return len(self.names)

    @classmethod
    def fit(cls, sections: list[tuple[str, str]], n_concepts: int, section_share: float = 0.2,
            window_words: int = 50, min_count: int = 5, max_df: float = 0.3) -> "StandInLabeller":
        """Build a library of at most ``n_concepts`` from (heading, text) sections.

        Keyword document frequency is measured over ~chunk-sized word windows, so a
        concept's positive rate on chunks is at most ~max_df; rarer words need min_count windows.
        """
        heads = Counter(h.lower() for h, _ in sections if h and "<unk>" not in h)
        n_sec = min(int(n_concepts * section_share), sum(1 for c in heads.values() if c >= 3))
        sec_names = [f"section:{h}" for h, _ in heads.most_common(n_sec)]
        df: Counter = Counter()
        n_win = 0
        for _, text in sections:
            words = text.lower().split()
            for i in range(0, max(1, len(words)), window_words):
                df.update(set(_WORD.findall(" ".join(words[i:i + window_words]))) - _STOP)
                n_win += 1
        band = [(w, c) for w, c in df.items() if min_count <= c <= max_df * n_win]
        band.sort(key=lambda wc: (-wc[1], wc[0]))
        kw_names = [f"kw:{w}" for w, _ in band[: n_concepts - len(sec_names)]]
        return cls(sec_names + kw_names)

    def label(self, text: str, section: str | None = None) -> list[int]:
        ids = {self._kw[w] for w in set(_WORD.findall(text.lower())) if w in self._kw}
        if section and section.lower() in self._sec:
            ids.add(self._sec[section.lower()])
        return sorted(ids)

    def display_name(self, i: int) -> str:
        return self.names[i].partition(":")[2]
