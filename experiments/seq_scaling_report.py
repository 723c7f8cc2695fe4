"""seq_scaling's tables and plot: the LM table summary, the attention and LM tables
printed after a run, and the four-panel figure."""
from __future__ import annotations

from experiments.scaling_common import human_bytes, seq_axis, setup_matplotlib


def summarize(rows):
  """The published-table view: LM memory (GB) per seq, tokens/s, and the 4K speedup."""
  lm = [r for r in rows if r["part"] == "lm"]
  table = {}
  for r in lm:
    key = f"{r['impl']}{' +remat' if r['remat'] else ''}"
    cell = ("OOM" if r["status"] == "oom" else r["status"] if r["status"] != "ok" else
            {"memory_gb": round(r["memory"]["total_bytes"] / 2**30, 2),
             "tokens_per_s": round(r["tokens_per_s"], 1)})
    table.setdefault(key, {})[r["seq"]] = cell
  out = {"lm_table": table}
  for T in sorted({r["seq"] for r in lm if not r["remat"]}):
    ok = {r["impl"]: r for r in lm if r["seq"] == T and not r["remat"] and r["status"] == "ok"}
    if "standard" in ok and "jflash" in ok:
      out.setdefault("jflash_speedup_tokens_per_s", {})[T] = round(
          ok["jflash"]["tokens_per_s"] / ok["standard"]["tokens_per_s"], 3)
  return out


def print_summary(rows):
  print_attention(rows)
  print_lm(rows)


def _cell(r) -> str:
  if r is None:
    return ""
  if r["status"] != "ok":
    return r["status"].upper()
  mem = human_bytes(r["memory"]["total_bytes"])
  return f"{mem}, {r['median_s'] * 1e3:.1f} ms" if r.get("timed") else f"{mem} (not timed)"


def print_attention(rows):
  att = [r for r in rows if r["part"] == "attention"]
  if not att:
    return
  seqs = sorted({r["seq"] for r in att})
  keys = list(dict.fromkeys((r["impl"], r["mode"]) for r in att))
  print("\nAttention op: compiled memory / median time per call")
  print("| impl | mode | " + " | ".join(str(T) for T in seqs) + " |")
  print("|---" * (len(seqs) + 2) + "|")
  for impl, mode in keys:
    by = {r["seq"]: r for r in att if r["impl"] == impl and r["mode"] == mode}
    print(f"| {impl} | {mode} | " + " | ".join(_cell(by.get(T)) for T in seqs) + " |")


def print_lm(rows):
  lm = [r for r in rows if r["part"] == "lm"]
  if not lm:
    return
  seqs = sorted({r["seq"] for r in lm})
  keys = sorted({(r["impl"], r["remat"]) for r in lm}, key=lambda k: (k[1], k[0]))
  print("\nLM training step: compiled memory / tokens per second")
  print("| impl | " + " | ".join(str(T) for T in seqs) + " |")
  print("|---" * (len(seqs) + 1) + "|")
  for impl, remat in keys:
    cells = []
    for T in seqs:
      r = next((r for r in lm if r["impl"] == impl and r["remat"] == remat and r["seq"] == T), None)
      if r is None:
        cells.append("")
      elif r["status"] == "ok":
        cells.append(f"{human_bytes(r['memory']['total_bytes'])}, {r['tokens_per_s']:.0f} tok/s")
      else:
        cells.append(r["status"].upper())
    print(f"| {impl}{' +remat' if remat else ''} | " + " | ".join(cells) + " |")


COLORS = {"standard": "tab:red", "jflash": "tab:blue", "cudnn": "tab:green"}


def plot(rows, path, title, budget):
  plt = setup_matplotlib()
  att = [r for r in rows if r["part"] == "attention"]
  lm = [r for r in rows if r["part"] == "lm"]
  fig, axes = plt.subplots(2, 2, figsize=(12, 9))

  def series(rs, x, y):
    pts = sorted((r[x], y(r)) for r in rs if r["status"] == "ok" and y(r) is not None)
    return [p[0] for p in pts], [p[1] for p in pts]

  def mark_oom(ax, rs, label, ypos):
    ooms = [r["seq"] for r in rs if r["status"] == "oom"]
    if ooms:
      ax.scatter(ooms, [ypos] * len(ooms), marker="x", s=90, color=COLORS.get(label, "k"),
                 zorder=5, label=f"{label} OOM")

  ax = axes[0, 0]
  for label in sorted({r["impl"] for r in att}):
    for mode, ls, mk in (("fwd", "--", "s"), ("fwd+bwd", "-", "o")):
      rs = [r for r in att if r["impl"] == label and r["mode"] == mode]
      xs, ys = series(rs, "seq", lambda r: r.get("memory", {}).get("total_bytes", 0) / 2**20)
      ax.plot(xs, ys, ls, marker=mk, ms=4, color=COLORS.get(label), label=f"{label} {mode}")
      if mode == "fwd+bwd" and budget:
        mark_oom(ax, rs, label, budget / 2**20)
  if budget:
    ax.axhline(budget / 2**20, color="gray", lw=0.8, ls=":", label="memory budget")
  ax.set(yscale="log", ylabel="compiled memory (MiB)",
         title="attention op: compiled memory (x: over budget = OOM)")
  seq_axis(ax, [r["seq"] for r in att])
  ax.legend(fontsize=7)

  ax = axes[0, 1]
  for label in sorted({r["impl"] for r in att}):
    for mode, ls, mk in (("fwd", "--", "s"), ("fwd+bwd", "-", "o")):
      rs = [r for r in att if r["impl"] == label and r["mode"] == mode and r.get("timed")]
      xs, ys = series(rs, "seq", lambda r: r["median_s"] * 1e3)
      ax.plot(xs, ys, ls, marker=mk, ms=4, color=COLORS.get(label), label=f"{label} {mode}")
  ax.set(yscale="log", ylabel="median time (ms)", title="attention op: time")
  seq_axis(ax, [r["seq"] for r in att if r.get("timed")])
  ax.legend(fontsize=7)

  ok_lm = [r["memory"]["total_bytes"] for r in lm if r["status"] == "ok"]
  gib = bool(ok_lm) and max(ok_lm) >= 2**30          # GiB on a GPU, MiB for CPU-sized models
  unit, div = ("GiB", 2**30) if gib else ("MiB", 2**20)
  for ax, key, ylabel, ttl in (
      (axes[1, 0], lambda r: r["memory"]["total_bytes"] / div, f"compiled memory ({unit})",
       "LM training step: compiled memory"),
      (axes[1, 1], lambda r: r["tokens_per_s"], "tokens / s", "LM training step: throughput")):
    for label in sorted({r["impl"] for r in lm}):
      for remat, ls in ((False, "-"), (True, ":")):
        rs = [r for r in lm if r["impl"] == label and r["remat"] == remat]
        if not rs:
          continue
        xs, ys = series(rs, "seq", key)
        name = f"{label}{' +remat' if remat else ''}"
        ax.plot(xs, ys, ls, marker="o", ms=4, color=COLORS.get(label), label=name)
        ooms = [r["seq"] for r in rs if r["status"] == "oom"]
        if ooms:
          ok_y = ys[-1] if ys else 1.0
          ax.scatter(ooms, [ok_y] * len(ooms), marker="x", s=90, color=COLORS.get(label),
                     zorder=5, label=f"{name} OOM")
    ax.set(ylabel=ylabel, title=ttl)
    seq_axis(ax, [r["seq"] for r in lm])
    ax.set_ylim(bottom=0)   # linear: the LM's memory spans a few x, not decades
    ax.legend(fontsize=7)
  for a in axes.flat:
    a.grid(True, which="both", alpha=0.3)
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


