"""CSS and the trajectory-browser script inlined into the HTML report (no CDN, no external files)."""

CSS = """
body { font: 14px/1.45 system-ui, -apple-system, Segoe UI, sans-serif; margin: 0; color: #1d2330; background: #f6f7f9; }
header { background: #1d2330; color: #fff; padding: 14px 24px; }
header h1 { margin: 0; font-size: 20px; } header p { margin: 4px 0 0; color: #b8c0cc; }
main { padding: 16px 24px; }
section { background: #fff; border: 1px solid #e1e4e8; border-radius: 8px; padding: 12px 16px; margin-bottom: 16px; }
h2 { font-size: 16px; margin: 0 0 10px; }
.charts { display: flex; flex-wrap: wrap; gap: 12px; }
.chart { border: 1px solid #eef0f3; border-radius: 6px; }
.chart text { font-size: 11px; fill: #5b6573; } .chart .title { font-size: 13px; fill: #1d2330; font-weight: 600; }
.chart .line { fill: none; stroke-width: 2; } .chart .band { opacity: 0.15; } .chart .grid { stroke: #eef0f3; }
table { border-collapse: collapse; font-size: 12px; } th, td { border-bottom: 1px solid #eef0f3; padding: 3px 8px; text-align: right; }
th { position: sticky; top: 0; background: #fff; } .scroll { max-height: 320px; overflow: auto; }
#browser .controls { display: flex; gap: 12px; align-items: center; margin-bottom: 8px; flex-wrap: wrap; }
#trajectory-list button { margin: 2px; border: 1px solid #d0d5dc; background: #fff; border-radius: 4px; padding: 2px 8px; cursor: pointer; }
#trajectory-list button.active { background: #1d2330; color: #fff; }
.summary { margin: 8px 0; color: #5b6573; }
.msg { border-left: 4px solid #c9ced6; padding: 4px 10px; margin: 6px 0; white-space: pre-wrap; word-break: break-word; }
.msg .role { font-weight: 600; font-size: 12px; text-transform: uppercase; color: #5b6573; display: block; }
.msg.system { border-color: #a0a7b4; } .msg.user { border-color: #3b82f6; } .msg.assistant { border-color: #16a34a; }
.msg.tool { border-color: #d97706; background: #fffbeb; }
h3.where { margin: 14px 0 4px; color: #1d4ed8; }
.toolcall { font-family: ui-monospace, monospace; font-size: 12px; background: #f3f4f6; padding: 2px 6px; margin-top: 4px; display: block; }
.tokens { font-family: ui-monospace, monospace; font-size: 12px; white-space: pre-wrap; line-height: 1.9; }
.tok { border-radius: 2px; padding: 1px 0; }
.legend { font-size: 12px; color: #5b6573; }
"""

# Renders the embedded JSON (script#report-data) into #viewer: split/step selects, a button per trajectory, then
# the messages, tool calls and each call's sampled tokens shaded by probability (red = unlikely).
SCRIPT = r"""
(function () {
  const data = JSON.parse(document.getElementById('report-data').textContent);
  const el = (tag, cls, text) => { const e = document.createElement(tag); if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = text; return e; };
  const splitSel = document.getElementById('split'), stepSel = document.getElementById('step');
  const list = document.getElementById('trajectory-list'), viewer = document.getElementById('viewer');
  const splits = Object.keys(data.trajectories);
  if (!splits.length) { viewer.textContent = 'No trajectories saved in this run.'; viewer.dataset.rendered = '1'; return; }
  splits.forEach(s => splitSel.appendChild(el('option', null, s)));
  function fillSteps() {
    stepSel.innerHTML = '';
    Object.keys(data.trajectories[splitSel.value]).sort((a, b) => a - b)
      .forEach(s => stepSel.appendChild(el('option', null, s)));
    stepSel.value = stepSel.options[stepSel.options.length - 1].value; fillList();
  }
  function fillList() {
    list.innerHTML = '';
    const items = data.trajectories[splitSel.value][stepSel.value];
    items.forEach((t, i) => { const b = el('button', null, '#' + i + '  r=' + (+t.reward).toFixed(3));
      b.onclick = () => show(i); list.appendChild(b); });
    show(0);
  }
  function shade(lp) {
    if (lp === null || lp === undefined) return '#e5e7eb';
    const p = Math.exp(lp); return 'rgba(220, 38, 38, ' + (0.08 + 0.72 * (1 - p)).toFixed(3) + ')';
  }
  function show(i) {
    [...list.children].forEach((b, j) => b.classList.toggle('active', i === j));
    const t = data.trajectories[splitSel.value][stepSel.value][i];
    viewer.innerHTML = '';
    const metrics = Object.entries(t.metrics).map(([k, v]) => k + '=' + v).join('  ');
    viewer.appendChild(el('div', 'summary', 'reward ' + t.reward + (metrics ? '   ' + metrics : '') +
      '   ' + t.calls.length + ' LLM call(s)' + (t.group !== null ? '   group ' + t.group : '')));
    t.messages.forEach(m => {
      const box = el('div', 'msg ' + m.role); box.appendChild(el('span', 'role', m.role + (m.name ? ' ' + m.name : '')));
      if (m.content) box.appendChild(document.createTextNode(m.content));
      (m.tool_calls || []).forEach(c => box.appendChild(el('span', 'toolcall', '\u2192 ' + c.name + '(' + c.arguments + ')')));
      viewer.appendChild(box);
    });
    const order = [], byWhere = {};  // calls grouped by where they came from (graph node, agent, role)
    t.calls.forEach((c, j) => { const w = c.where || '';
      if (!(w in byWhere)) { byWhere[w] = []; order.push(w); } byWhere[w].push([c, j]); });
    order.forEach(w => {
      if (w) viewer.appendChild(el('h3', 'where', w + ' \u00b7 ' + byWhere[w].length + ' call(s)'));
      byWhere[w].forEach(([c, j]) => {
        if (!c.tokens.length) return;
        const version = c.version === null || c.version === undefined ? '' : ', sampled by version ' + c.version;
        const adapter = c.adapter ? ', adapter ' + c.adapter + (c.served_model ? ' (' + c.served_model + ')' : '') : '';
        viewer.appendChild(el('h4', null, 'call ' + j + ': sampled tokens (' + c.model + version + adapter + ', ' + c.tokens.length + ' tokens)'));
        const div = el('div', 'tokens');
        c.tokens.forEach(([piece, lp, id]) => { const s = el('span', 'tok', piece); s.style.background = shade(lp);
          s.title = 'id ' + id + (lp === null ? '' : '  logprob ' + lp.toFixed(4) + '  p ' + Math.exp(lp).toFixed(3));
          div.appendChild(s); });
        viewer.appendChild(div);
      });
    });
    (t.logs || []).forEach(l => viewer.appendChild(el('div', 'legend', 'log: ' + l)));
    viewer.dataset.rendered = '1';
  }
  splitSel.onchange = fillSteps; stepSel.onchange = fillList; fillSteps();
})();
"""
