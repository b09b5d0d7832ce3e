"""The doctor's report: every measurement as data, a notebook table (HTML), JSON, and a
self-contained HTML page (inline CSS, a static SVG figure and the data as JSON: no script runs,
and the page stays well under 1 MB). The verdict comes first in every form."""
from __future__ import annotations

import html
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from amp_lessons.tables import format_value, html_table, json_safe, percent, plural, spread_text
from amp_lessons.files import write_atomic

# scoped to the report's <div>, so a notebook's own styles stay as they are
CSS = (".amp-doctor table{border-collapse:collapse;margin:.4em 0 1em;font-size:13px}"
       ".amp-doctor td,.amp-doctor th{border:1px solid #ccc;padding:2px 6px}"
       ".amp-doctor th{background:#f2f2f2}")
PAGE_CSS = "body{font-family:system-ui,sans-serif;margin:1.5em;max-width:1200px}" + CSS
LAYER_COLUMNS = (("layer", "layer"), ("kind", "kind"), ("act_absmax", "max |act|"),
                 ("act_min", "min |act|"), ("grad_absmax", "max |grad|"),
                 ("grad_min", "min |grad|"), ("act_fp16_overflow", "act fp16 over"),
                 ("grad_fp16_underflow", "grad fp16 under"), ("grad_bf16_underflow", "grad bf16 under"),
                 ("act_e4m3_overflow", "act e4m3 over"), ("act_e4m3_underflow", "act e4m3 under"),
                 ("grad_e5m2_underflow", "grad e5m2 under"))
GRADIENT_COLUMNS = (("parameter", "parameter"), ("values", "nonzero values"),
                    ("share_default", "flushed at 2^16"), ("error_default", "rel. error at 2^16"),
                    ("share_k", "flushed at the reached scale"),
                    ("error_k", "rel. error there"))
SPEED_COLUMNS = (("precision", "precision"), ("samples_per_s", "samples/s"),
                 ("speedup", "x fp32"), ("step_ms", "step ms"), ("peak_gib", "peak GiB"),
                 ("memory_ratio", "mem x fp32"), ("gpu_idle_fraction", "GPU idle"),
                 ("spread", "repeat spread"), ("status", "status"),
                 ("gate", "not decided because"))


@dataclass
class DoctorReport:
    """What ``doctor`` measured on one model (see the package docstring for each part)."""

    model: str
    parameters: int
    device: str
    device_name: str
    torch: str
    batch: str
    loss: str
    layers: List[Dict[str, object]]
    scale_exponent: Optional[int]
    overflow: List[Dict[str, object]]
    fp16_nonfinite: List[str]
    advice: Dict[str, object]
    scaler_trial: List[Dict[str, object]]
    trace: Dict[str, object]
    compiled: Dict[str, object]
    speed: List[Dict[str, object]]
    fp8: Dict[str, object]
    findings: List[Dict[str, str]]
    seconds: float = 0.0
    extra: Dict[str, object] = field(default_factory=dict)
    verdict: Dict[str, object] = field(default_factory=dict)
    output: str = "the model's output"
    read_as: str = "inputs"
    gradient_loss: List[Dict[str, object]] = field(default_factory=list)
    probes: Dict[str, object] = field(default_factory=dict)
    weights: Dict[str, object] = field(default_factory=dict)
    step_check: Dict[str, object] = field(default_factory=dict)
    checkpoint_check: Dict[str, object] = field(default_factory=dict)
    no_gradient: List[str] = field(default_factory=list)

    # -- data ------------------------------------------------------------------------------------
    def to_dict(self) -> Dict[str, object]:
        """Everything, as plain JSON-ready data; the verdict first."""
        doc = asdict(self)
        return json_safe({"verdict": doc.pop("verdict"), **doc})

    def verdict_line(self) -> str:
        """The verdict as one line: ``verdict for DEVICE: what to train in``."""
        if not self.verdict:
            return "verdict: not made"
        line = f"verdict for {self.verdict['device']}: {self.verdict['text']}"
        return line + (f" ({self.verdict['on_gpu']})" if self.verdict.get("on_gpu") else "")

    def alarms(self) -> List[Dict[str, str]]:
        """The findings with severity ``alarm``: the failure classes found."""
        return [f for f in self.findings if f.get("severity") == "alarm"]

    def to_json(self) -> str:
        """``to_dict`` as JSON text."""
        return json.dumps(self.to_dict(), indent=1)

    def speed_row(self, precision: str) -> Optional[Dict[str, object]]:
        """The speed row of ``precision`` (None when not in the report)."""
        return next((r for r in self.speed if r["precision"] == precision), None)

    def riskiest_layers(self, n: int = 12) -> List[Dict[str, object]]:
        """The ``n`` layers nearest to fp16's limits at either end: half of them by activation
        (overflowing share, then the largest activation), the rest by the share of their
        gradients that underflows fp16 at the reached scale (so a layer whose gradients vanish
        is listed however small its activations are), each layer once."""
        def act(r):
            return (r.get("act_fp16_overflow") or 0, r.get("act_absmax") or 0)

        def grad(r):
            return (r.get("grad_fp16_underflow") or 0, -(r.get("grad_min") or 0))
        top_act = sorted(self.layers, key=act, reverse=True)[:(n + 1) // 2]
        chosen = {id(r) for r in top_act}
        rest = [r for r in sorted(self.layers, key=grad, reverse=True) if id(r) not in chosen]
        return (top_act + rest)[:n]

    # -- rendering -------------------------------------------------------------------------------
    @staticmethod
    def _cell(key: str, value) -> str:
        if value is None or (isinstance(value, float) and value != value):
            return "n/a"
        if isinstance(value, bool):
            return "yes" if value else "no"
        if key.endswith("spread") and isinstance(value, float):
            return spread_text(value)  # a ratio to the median: it can pass 100%
        if (key.endswith(("_overflow", "_underflow", "idle_fraction", "share")) or
                key.startswith(("share_", "error_"))) and isinstance(value, float):
            return percent(value, 1.0)
        if isinstance(value, float):
            return format_value(value, 3) if abs(value) >= 1e-3 or value == 0 else f"{value:.3g}"
        return str(value)

    @classmethod
    def html_table(cls, rows: Sequence[Dict[str, object]], columns) -> str:
        """Rows as an HTML table (``tables.html_table``, the course's one table formatter) with
        the given ``(key, heading)`` columns: shares in percent, small numbers never rounded to 0."""
        if not rows:
            return "<p><i>none</i></p>"
        return html_table(rows, [(k, h, lambda v, k=k: cls._cell(k, v)) for k, h in columns])

    def html_body(self, all_layers: bool = False) -> str:
        """The report's HTML (no page wrapper): findings, loss scale, overflow sites, speed,
        dtype trace, compile and FP8 sections, and the layer table (the riskiest 12 layers,
        or every layer with ``all_layers``)."""
        e = html.escape
        parts = [f"<h3>doctor: {e(self.model)} ({plural(self.parameters, 'parameter')}) on "
                 f"{e(self.device_name)}</h3>",
                 f"<p class=\"verdict\"><b>{e(self.verdict_line())}</b></p>",
                 f"<p>batch {e(self.batch)}; loss: {e(self.loss)}; torch {e(self.torch)}; "
                 f"{self.seconds:.1f} s ("
                 + ", ".join(f"{e(k)} {v:.1f} s" for k, v in
                             self.extra.get("seconds_by_part", {}).items()) + ")</p>",
                 "<h4>Findings</h4>",
                 self.html_table(self.findings, (("severity", "severity"),
                                                 ("finding", "finding"), ("site", "site"),
                                                 ("evidence", "measured by"), ("fix", "fix"),
                                                 ("lesson", "explained in"))),
                 "<h4>Gradient underflow per parameter (worst first)</h4>",
                 self.html_table(self.gradient_loss[:12], GRADIENT_COLUMNS),
                 "<h4>Loss scale</h4><ul>"
                 + "".join(f"<li>{e(line)}</li>" for line in self.advice.get("lines", []))
                 + "</ul>",
                 self.html_table(self.scaler_trial, (("settings", "fp16 trial"),
                                                     ("init_scale", "init_scale"),
                                                     ("steps", "steps"), ("skipped", "skipped"),
                                                     ("final_scale", "final scale"),
                                                     ("final_loss", "final loss"))
                                 + ((("status", "status"), ("reason", "reason"))
                                    if any(r.get("status", "ok") != "ok"
                                           for r in self.scaler_trial) else ())),
                 "<h4>fp16 overflow sites</h4>",
                 self.html_table(self.overflow, (("layer", "layer"), ("kind", "kind"),
                                                 ("value", "largest |activation|"),
                                                 ("share", "share over 65,504"))),
                 "<h4>Speed and peak memory per precision</h4>",
                 self.html_table(self.speed, SPEED_COLUMNS),
                 f"<h4>Autocast ({e(str(self.trace.get('low', '')))}): ops by output dtype</h4>",
                 self.html_table(self.trace.get("ops", []), (("op", "op"), ("dtype", "dtype"),
                                                             ("calls", "calls"))),
                 "<h4>Eager against torch.compile</h4>",
                 (self.html_table(self.compiled["rows"], (
                     ("precision", "precision"), ("output", "output"), ("shape", "shape"),
                     ("max_abs_diff", "max |diff|"), ("max_rel_diff", "relative"),
                     ("compile_s", "first call s"), ("status", "status"), ("reason", "reason")))
                  if self.compiled.get("rows") else
                  f"<p>not run: {e(self.compiled.get('reason', ''))}</p>"),
                 f"<h4>FP8 candidates: {e(self.fp8.get('summary', self.fp8['status']))}</h4>"
                 f"<p>{e(self.fp8['reason'])}</p>",
                 self.html_table(self.fp8.get("layers", []), (
                     ("layer", "Linear"), ("in", "in"), ("out", "out"),
                     ("precision", "trains in"), ("reason", "why"))) if self.fp8.get("layers") else "",
                 f"<h4>Layer ranges ({'every layer' if all_layers else 'the 12 nearest fp16 limits'}"
                 f"; {self._scale_words()})</h4>",
                 self.html_table(self.layers if all_layers else self.riskiest_layers(),
                                 LAYER_COLUMNS)]
        return '<div class="amp-doctor">\n' + "\n".join(parts) + "\n</div>"

    def _scale_words(self) -> str:
        if self.scale_exponent is not None:
            return f"gradients at the loss scale 2^{self.scale_exponent}"
        return ("gradients unscaled: loss scale not derived, no finite nonzero gradient was "
                "found")

    def _repr_html_(self) -> str:
        return f"<style>{CSS}</style>" + self.html_body()

    def __repr__(self) -> str:
        return (f"DoctorReport({self.model}: {self.verdict_line()}; "
                + "; ".join(f["finding"] for f in self.findings[:3]) + ")")

    def to_html(self, figure_html: str = "") -> str:
        """A self-contained page: inline CSS, every table (all layers), ``figure_html`` (a static
        figure: ``ui.doctor_plots.ranges_svg``) and the report's data as JSON in a
        ``<script type="application/json" id="doctor-data">`` block (data, not code)."""
        data = self.to_json().replace("</", "<\\/")
        return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>amp-lessons doctor: "
                f"{html.escape(self.model)}</title><style>{PAGE_CSS}</style></head><body>\n"
                f"{self.html_body(all_layers=True)}\n{figure_html}\n"
                f"<script type=\"application/json\" id=\"doctor-data\">{data}</script>\n"
                f"</body></html>\n")

    def write(self, path, figure_html: str = "") -> Path:
        """Write the report to ``path``: JSON for ``.json``, the HTML page for ``.html``/``.htm``."""
        path = Path(path)
        suffix = path.suffix.lower()
        if suffix not in (".json", ".html", ".htm"):
            raise ValueError(f"path must end in .json, .html or .htm; got '{path}'")
        return write_atomic(path, self.to_json() if suffix == ".json" else self.to_html(figure_html),
                            what="doctor report")
