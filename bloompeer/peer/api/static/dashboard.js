// Polls /api/swarm and redraws the page: blocks and how many online servers cover each, then one
// row per server. Written with DOM calls only (no innerHTML), since records come from other peers.
"use strict";

const PERIOD_MS = 2000;

function element(tag, text, className) {
  const node = document.createElement(tag);
  if (text !== undefined) node.textContent = text;
  if (className) node.className = className;
  return node;
}

function shortId(peerId) {
  return "…" + peerId.slice(-8);
}

// One row per server and span: a server moving to other blocks (--num-blocks) has records for both,
// the old span draining, then offline, the new one joining, then online.
function serversOf(state) {
  const bySpan = new Map();
  for (const block of state.blocks) {
    for (const record of block.servers) bySpan.set(`${record.peer_id} ${record.start}:${record.end}`, record);
  }
  return [...bySpan.values()].sort((a, b) => a.start - b.start || a.peer_id.localeCompare(b.peer_id));
}

function drawBlocks(state) {
  const container = document.getElementById("blocks");
  container.replaceChildren();
  for (const block of state.blocks) {
    const online = block.servers.filter((record) => record.state === "online").length;
    const cell = element("div", undefined, `block covered-${Math.min(online, 2)}`);
    cell.dataset.block = block.index;
    cell.title = `block ${block.index}: ${online} online server(s)`;
    cell.append(element("b", String(block.index)), `×${online}`);
    container.append(cell);
  }
}

function drawServers(state) {
  const body = document.querySelector("#servers tbody");
  body.replaceChildren();
  for (const record of serversOf(state)) {
    const latency = state.latency_s[record.peer_id];
    const row = element("tr");
    row.dataset.peerId = record.peer_id;
    const id = element("td");
    id.append(element("code", shortId(record.peer_id)));
    id.title = record.peer_id;
    row.append(
      id,
      element("td", `${record.start}:${record.end}`, "number"),
      element("td", record.state, `state-${record.state}`),
      element("td", record.weights),
      element("td", record.throughput.toFixed(1), "number"),
      element("td", String(record.cache_tokens_left), "number"),
      element("td", record.relayed ? "relayed" : "direct"),
      element("td", latency === null || latency === undefined ? "not measured" : `${(latency * 1000).toFixed(1)} ms`,
              "number"),
    );
    body.append(row);
  }
}

// A mixture of experts in words, as `bloompeer status` says it (swarm_status.describe_experts); "" if dense.
function describeExperts(state) {
  const sparse = [...new Set(state.blocks.filter((block) => block.experts)
    .map((block) => `${block.experts} experts a block, ${block.experts_per_token} used a token`))];
  if (!sparse.length) return "";
  const dense = state.blocks.filter((block) => !block.experts).map((block) => block.index);
  const denseText = dense.length ? `; dense: block${dense.length > 1 ? "s" : ""} ${dense.join(", ")}` : "";
  return `; ${sparse.join("; ")}${denseText}`;
}

function drawSummary(state) {
  document.getElementById("model").textContent = state.model;
  const summary = document.getElementById("summary");
  const uncovered = state.missing;  // blocks no online server covers
  const servers = new Set(serversOf(state).map((record) => record.peer_id)).size;
  const experts = describeExperts(state);
  if (uncovered.length) {
    summary.textContent = `${state.num_blocks} blocks${experts}, ${servers} server(s); NOT COVERED: block(s) ${uncovered.join(", ")}`;
    summary.className = "missing";
  } else {
    summary.textContent = `${state.num_blocks} blocks${experts}, all covered, by ${servers} server(s)`;
    summary.className = "";
  }
}

async function refresh() {
  try {
    const response = await fetch("/api/swarm", {cache: "no-store"});
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const state = await response.json();
    drawSummary(state);
    drawBlocks(state);
    drawServers(state);
    document.getElementById("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
    document.body.dataset.loaded = "true";
  } catch (error) {
    document.getElementById("updated").textContent = `could not refresh: ${error.message}`;
  }
}

document.getElementById("period").textContent = String(PERIOD_MS / 1000);
refresh();
setInterval(refresh, PERIOD_MS);
