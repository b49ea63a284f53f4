// Line charts on <canvas>, drawn by hand: time on x (the last `windowS` seconds up to `now`),
// one y axis, a legend on top. A null value breaks its line (no data in that interval).
//
//   series: [{ label, color, points: [[tSeconds, value | null], ...] }]
//   options: { windowS, now, yMax (fixed, or null for the data's max), format(value) }

const MARGIN = { left: 52, right: 12, top: 24, bottom: 22 };
const GRID = "#e4e7ed";
const TEXT = "#6b7385";

export function drawChart(canvas, series, options) {
  const ctx = setUp(canvas);
  const width = canvas.clientWidth;
  const height = canvas.clientHeight;
  const box = {
    x: MARGIN.left,
    y: MARGIN.top,
    w: width - MARGIN.left - MARGIN.right,
    h: height - MARGIN.top - MARGIN.bottom,
  };
  const yMax = options.yMax ?? niceMax(series);
  const x = (t) => box.x + box.w * (1 - (options.now - t) / options.windowS);
  const y = (v) => box.y + box.h * (1 - Math.min(v, yMax) / yMax);
  drawGrid(ctx, box, yMax, options);
  drawXTicks(ctx, box, options.windowS);
  ctx.save();
  ctx.beginPath();
  ctx.rect(box.x, box.y - 2, box.w, box.h + 4);
  ctx.clip();
  for (const s of series) drawLine(ctx, s, x, y, options.now - options.windowS);
  ctx.restore();
  drawLegend(ctx, series, box);
  if (!series.some((s) => s.points.some(([, v]) => v !== null && v !== undefined))) {
    ctx.fillStyle = TEXT;
    ctx.textAlign = "center";
    ctx.fillText("no data yet", box.x + box.w / 2, box.y + box.h / 2);
  }
}

// Canvas pixels = CSS pixels × devicePixelRatio, so lines stay sharp on any screen.
function setUp(canvas) {
  const ratio = window.devicePixelRatio || 1;
  const w = Math.round(canvas.clientWidth * ratio);
  const h = Math.round(canvas.clientHeight * ratio);
  if (canvas.width !== w || canvas.height !== h) {
    canvas.width = w;
    canvas.height = h;
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, canvas.clientWidth, canvas.clientHeight);
  ctx.font = "11px system-ui, sans-serif";
  ctx.textBaseline = "middle";
  return ctx;
}

function niceMax(series) {
  let max = 0;
  for (const s of series) for (const [, v] of s.points) if (v > max) max = v;
  if (max <= 0) return 1;
  const step = 10 ** Math.floor(Math.log10(max));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * step >= max * 1.05) return m * step;
  return 10 * step;
}

function drawGrid(ctx, box, yMax, options) {
  ctx.strokeStyle = GRID;
  ctx.fillStyle = TEXT;
  ctx.textAlign = "right";
  ctx.lineWidth = 1;
  for (let i = 0; i <= 4; i += 1) {
    const value = (yMax * i) / 4;
    const py = Math.round(box.y + box.h * (1 - i / 4)) + 0.5;
    ctx.beginPath();
    ctx.moveTo(box.x, py);
    ctx.lineTo(box.x + box.w, py);
    ctx.stroke();
    ctx.fillText(options.format(value), box.x - 6, py);
  }
}

function drawXTicks(ctx, box, windowS) {
  const step = windowS > 600 ? 300 : windowS > 180 ? 60 : windowS > 60 ? 30 : 15;
  ctx.fillStyle = TEXT;
  ctx.textAlign = "center";
  for (let back = 0; back <= windowS; back += step) {
    const px = box.x + box.w * (1 - back / windowS);
    const label = back === 0 ? "now" : back % 60 ? `-${back}s` : `-${back / 60}m`;
    ctx.fillText(label, px, box.y + box.h + 12);
  }
}

function drawLine(ctx, series, x, y, tMin) {
  ctx.strokeStyle = series.color;
  ctx.fillStyle = series.color;
  ctx.lineWidth = 2;
  ctx.lineJoin = "round";
  let drawing = false;
  let lone = null; // a point with no neighbour still shows, as a dot
  ctx.beginPath();
  for (const [t, v] of series.points) {
    if (t < tMin || v === null || v === undefined) {
      if (lone) dot(ctx, lone);
      drawing = false;
      lone = null;
      continue;
    }
    const p = [x(t), y(v)];
    if (drawing) {
      ctx.lineTo(...p);
      lone = null;
    } else {
      ctx.moveTo(...p);
      lone = p;
    }
    drawing = true;
  }
  ctx.stroke();
  if (lone) dot(ctx, lone);
}

function dot(ctx, [px, py]) {
  ctx.beginPath();
  ctx.arc(px, py, 2.5, 0, 2 * Math.PI);
  ctx.fill();
}

function drawLegend(ctx, series, box) {
  let px = box.x;
  ctx.textAlign = "left";
  for (const s of series) {
    ctx.fillStyle = s.color;
    ctx.fillRect(px, 6, 10, 10);
    ctx.fillStyle = TEXT;
    ctx.fillText(s.label, px + 14, 11);
    px += 22 + ctx.measureText(s.label).width;
  }
}
