// The live swarm page: polls /api/v1/swarm and draws the blocks, the servers over them, chains and events.
"use strict";

const PERIOD_MS = 2000;

function element(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attributes)) {
    if (key === "class") node.className = value;
    else if (key === "style") Object.assign(node.style, value);
    else node.setAttribute(key, value);
  }
  for (const child of children) node.append(child);
  return node;
}

function shortId(peerId) {
  return peerId.length > 10 ? "…" + peerId.slice(-8) : peerId;
}

function columns(numBlocks) {
  return `repeat(${Math.max(numBlocks, 1)}, minmax(0, 1fr))`;
}

function drawCoverage(swarm) {
  const bar = document.getElementById("coverage");
  bar.style.gridTemplateColumns = columns(swarm.num_blocks);
  bar.replaceChildren(...swarm.coverage.map((count, block) => element(
    "div", {class: `block ${count > 0 ? "covered" : "gap"}`, "data-block": String(block),
            title: `block ${block}: ${count} online server(s)`}, String(count))));
}

function drawServers(swarm) {
  const lanes = swarm.servers.map((server) => {
    const lane = element("div", {class: "lane", style: {gridTemplateColumns: columns(swarm.num_blocks)}});
    const [start, end] = server.blocks;
    if (server.restorable) {
      const [from, to] = server.restorable;
      if (from < start) lane.append(element("div", {class: "ghost", style: {gridColumn: `${from + 1} / ${start + 1}`}}));
    }
    const used = server.pages_total - server.pages_free;
    const speed = server.throughput === null ? "" : `${server.throughput.toFixed(1)} tok/s · `;
    const label = server.public_name || shortId(server.peer_id);
    const box = element("div", {
      class: `server ${server.state}${server.restorable ? " restorable" : ""}`, "data-peer": server.peer_id,
      title: `${server.peer_id}\n${server.state}, blocks ${start}:${end}`,
      style: {gridColumn: `${start + 1} / ${Math.max(end, start + 1) + 1}`},
    }, `${label} [${start}:${end}]`, element("small", {},
      `${speed}pages ${used} used, ${server.pages_free} free · ${server.sessions} session(s)`));
    lane.append(box);
    if (server.restorable && server.restorable[1] > end) {
      lane.append(element("div", {class: "ghost", style: {gridColumn: `${end + 1} / ${server.restorable[1] + 1}`}}));
    }
    return lane;
  });
  document.getElementById("servers").replaceChildren(...lanes);
}

function drawChains(swarm) {
  const section = document.getElementById("orchestrator-section");
  section.hidden = swarm.orchestrator === null;
  if (swarm.orchestrator === null) return;
  const orchestrator = swarm.orchestrator;
  document.getElementById("queue").textContent = orchestrator.error
    ? `orchestrator ${shortId(orchestrator.peer_id || "")}: ${orchestrator.error}`
    : `orchestrator ${shortId(orchestrator.peer_id || "")}: ${orchestrator.queued} queued, ` +
      `${orchestrator.dispatched} dispatched`;
  const names = new Map(swarm.servers.map((server) => [server.peer_id, server.public_name || shortId(server.peer_id)]));
  const rows = (swarm.chains || []).map((chain, index) => element("tr", {},
    element("td", {}, String(index)),
    element("td", {}, chain.servers.map(
      (peer, hop) => `${names.get(peer) || shortId(peer)} [${chain.blocks[hop].join(":")}]`).join(" → ")),
    element("td", {}, String(chain.capacity)), element("td", {}, String(chain.in_use))));
  document.querySelector("#chains tbody").replaceChildren(...rows);
}

const VERBS = {blocks: "moved", moved_in: "took sessions"};  // the other kinds read as they are

function drawEvents(swarm) {
  const items = swarm.events.map((event) => element("li", {},
    element("time", {}, new Date(event.at * 1000).toLocaleTimeString()),
    `${event.name} ${VERBS[event.kind] || event.kind}: ${event.detail}`));
  if (items.length === 0) items.push(element("li", {}, "nothing yet"));
  document.getElementById("events").replaceChildren(...items);
}

function draw(swarm) {
  document.getElementById("model").textContent = `${swarm.model} (${swarm.num_blocks} blocks)`;
  const gaps = swarm.coverage.filter((count) => count === 0).length;
  const summary = document.getElementById("summary");
  summary.className = gaps || swarm.error ? "error" : "";
  summary.textContent = `${swarm.servers.length} server(s); ` +
    (gaps ? `${gaps} block(s) have no online server` : "every block is served") +
    (swarm.error ? `; last read failed: ${swarm.error}` : "") +
    (swarm.updated_at ? ` · read ${new Date(swarm.updated_at * 1000).toLocaleTimeString()}` : "");
  drawCoverage(swarm);
  drawServers(swarm);
  drawChains(swarm);
  drawEvents(swarm);
}

async function poll() {
  try {
    const response = await fetch("/api/v1/swarm", {cache: "no-store"});
    if (response.ok) draw(await response.json());
  } catch (error) {
    document.getElementById("summary").textContent = `cannot reach the API: ${error}`;
  }
  setTimeout(poll, PERIOD_MS);
}

poll();
