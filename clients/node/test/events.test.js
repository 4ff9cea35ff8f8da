'use strict';
// WatchEvents against real `kvsvc serve` processes: stored and removed (evicted)
// events arrive and an index fed by them equals what Lookup says; a cursor resumes
// from the ring; a cursor of another incarnation, or one the ring dropped, gets
// `lost`, a paged snapshot of what is present, then live events with no gap and no
// duplicate; the stream ends with typed errors; after a kill -9 the next
// incarnation answers the kept cursor with lost + snapshot.
const test = require('node:test');
const assert = require('node:assert/strict');
const crypto = require('node:crypto');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const kv = require('../src');
const { startServer, refusedAddress } = require('./helpers/server');

const uniq = (prefix) => `${prefix}-${crypto.randomUUID()}`;
const hex = (b) => b.toString('hex');
/** Every wait in these tests is bounded by this (a loaded 2-core CI gets room). */
const WAIT_MS = 20_000;

/**
 * Reads a watch in the background: keeps every batch, applies it to an index
 * (namespace -> Set of hex keys) and ends with the stream's error (null after close()).
 */
function follow(watch) {
  const feed = {
    watch, batches: [], index: new Map(), error: undefined, waiters: new Set(),
    keys(ns) { return [...(this.index.get(ns) ?? [])].sort(); },
    /** Resolves once pred(feed) holds; rejects after ms, or when the stream ended first. */
    until(pred, what, ms = WAIT_MS) {
      return new Promise((resolve, reject) => {
        const w = {
          check: () => {
            if (pred(feed)) { finish(); resolve(); return; }
            if (feed.error !== undefined) {
              finish();
              reject(new Error(`stream ended before ${what}: ${feed.error}`, { cause: feed.error }));
            }
          },
        };
        const timer = setTimeout(() => {
          finish();
          reject(new Error(`no ${what} within ${ms} ms; ${feed.batches.length} batches`));
        }, ms);
        const finish = () => { clearTimeout(timer); feed.waiters.delete(w); };
        feed.waiters.add(w);
        w.check();
      });
    },
  };
  const apply = (batch) => {
    if (batch.lost) feed.index.clear();
    for (const ev of batch.events) {
      if (ev.kind === 'cleared') { feed.index.clear(); continue; }
      const e = ev[ev.kind];
      if (!feed.index.has(e.namespace)) feed.index.set(e.namespace, new Set());
      const set = feed.index.get(e.namespace);
      for (const k of e.keys) {
        if (ev.kind === 'stored') set.add(hex(k));
        else set.delete(hex(k));
      }
    }
  };
  feed.done = (async () => {
    try {
      for await (const batch of watch) {
        feed.batches.push(batch);
        apply(batch);
        for (const w of [...feed.waiters]) w.check();
      }
      feed.error = null;
    } catch (err) {
      feed.error = err;
    }
    for (const w of [...feed.waiters]) w.check();
  })();
  return feed;
}

const events = (feed, kind, ns) => feed.batches.flatMap((b) => b.events
  .filter((e) => e.kind === kind && (ns === undefined || e[kind].namespace === ns))
  .map((e) => ({ ...e[kind], batch: b })));
const keysOf = (evs) => evs.flatMap((e) => e.keys.map(hex));
const chunksOf = (n, size) => Array.from({ length: n }, () => ({
  key: crypto.randomBytes(16), data: crypto.randomBytes(size),
}));
/** The server's truth for these keys: each key's own Lookup. */
async function present(client, ns, keys) {
  const out = [];
  for (const k of keys) if ((await client.lookup(ns, [k])).hitChunks === 1) out.push(hex(k));
  return out.sort();
}

test('stored and evicted keys arrive as events; the index they feed equals Lookup', async (t) => {
  const server = await startServer({ args: ['--store-bytes', '1M'] });
  const client = new kv.KVClient(server.address);
  t.after(async () => { client.close(); await server.stop(); });
  const ns = uniq('evict');
  const feed = follow(client.watchEvents({ namespaces: [ns] }));
  t.after(() => feed.watch.close());
  await feed.until((f) => f.batches.some((b) => b.snapshotDone), 'end of the first snapshot');
  assert.equal(feed.batches[0].lost, true, 'no cursor: the first batch is `lost`');
  assert.deepEqual(feed.keys(ns), [], 'nothing stored yet');
  const start = feed.watch.cursor;
  assert.ok(start && start.incarnation === (await client.serverInfo()).serverStartId);

  // 40 x 64 KiB into a 1 MiB store: the first ones are evicted.
  const chunks = chunksOf(40, 64 << 10);
  const sizes = new Map(chunks.map((c) => [hex(c.key), c.data.length]));
  for (let i = 0; i < chunks.length; i += 4) await client.store(ns, chunks.slice(i, i + 4));
  const last = hex(chunks[chunks.length - 1].key);
  await feed.until((f) => f.index.get(ns)?.has(last), 'the last stored key');

  const stored = events(feed, 'stored', ns);
  assert.deepEqual(new Set(keysOf(stored)), new Set(sizes.keys()), 'every stored key, once');
  assert.equal(keysOf(stored).length, chunks.length, 'no stored key twice');
  for (const e of stored) {
    assert.equal(e.layout, 'inline');
    assert.equal(e.tier, 'TIER_MEMORY');
    assert.equal(e.bytes, e.keys.reduce((n, k) => n + sizes.get(hex(k)), 0), 'bytes of its keys');
    assert.equal(e.batch.lost || e.batch.snapshot, false, 'live events');
  }
  const removed = events(feed, 'removed', ns);
  assert.ok(removed.length > 0, 'a 1 MiB store evicted some of 2.5 MiB');
  for (const e of removed) {
    assert.equal(e.reason, 'REMOVAL_REASON_EVICTED');
    assert.equal(e.tier, 'TIER_MEMORY');
    assert.equal(e.layout, 'inline');
    for (const k of e.keys) assert.ok(sizes.has(hex(k)), 'only keys that were stored');
  }
  assert.ok(keysOf(removed).includes(hex(chunks[0].key)), 'the least recently used went first');

  // Sequences grow; each batch's cursor is its own point.
  let prev = start.sequence;
  for (const b of feed.batches.slice(feed.batches.findIndex((x) => x.snapshotDone) + 1)) {
    assert.ok(b.sequence > prev, `sequence ${b.sequence} after ${prev}`);
    assert.deepEqual(b.cursor, { incarnation: start.incarnation, sequence: b.sequence });
    prev = b.sequence;
  }
  assert.deepEqual(feed.keys(ns), await present(client, ns, chunks.map((c) => c.key)),
    'the index equals the server');
  assert.equal(feed.error, undefined, 'the stream is still open');
});

test('a cursor resumes from the ring; a foreign or dropped one gets lost + snapshot, then live', async (t) => {
  const server = await startServer({ args: ['--events-ring', '16'] });
  const client = new kv.KVClient(server.address);
  t.after(async () => { client.close(); await server.stop(); });
  const ns = uniq('resume');
  const k1 = chunksOf(5, 100);
  await client.store(ns, k1);

  // No cursor: lost, a snapshot in pages of 2 keys (no cursor inside it), then live.
  let feed = follow(client.watchEvents({ namespaces: [ns], snapshotPageKeys: 2 }));
  await feed.until((f) => f.batches.some((b) => b.snapshotDone), 'the snapshot');
  const pages = feed.batches.filter((b) => b.snapshot);
  assert.equal(feed.batches[0].lost, true);
  assert.ok(pages.length >= 3, `5 keys in pages of 2: ${pages.length} pages`);
  for (const b of feed.batches.slice(0, -1)) assert.equal(b.cursor, null, 'no cursor inside a resync');
  assert.deepEqual(feed.keys(ns), k1.map((c) => hex(c.key)).sort());
  const snapPoint = pages[0].sequence;
  for (const b of pages) assert.equal(b.sequence, snapPoint, 'every page carries the point S');
  const cursor = feed.watch.cursor;
  assert.deepEqual(cursor, { incarnation: pages[0].incarnation, sequence: snapPoint });
  feed.watch.close();
  await feed.done;
  assert.equal(feed.error, null, 'close() ends the iteration quietly');

  // Resume from the ring: no lost, exactly what happened since.
  const k2 = chunksOf(3, 100);
  await client.store(ns, k2);
  feed = follow(client.watchEvents({ namespaces: [ns], cursor }));
  await feed.until((f) => keysOf(events(f, 'stored', ns)).length >= 3, 'the events since the cursor');
  assert.equal(feed.batches.some((b) => b.lost || b.snapshot), false, 'served from the ring');
  assert.deepEqual(keysOf(events(feed, 'stored', ns)).sort(), k2.map((c) => hex(c.key)).sort());
  assert.ok(feed.batches[0].sequence > cursor.sequence);
  const resumed = feed.watch.cursor;
  feed.watch.close();

  // A cursor of another incarnation: lost, the snapshot holds k1 + k2 + k3, then live.
  const k3 = chunksOf(2, 100);
  await client.store(ns, k3);
  feed = follow(client.watchEvents({
    namespaces: [ns], cursor: { incarnation: `not-${resumed.incarnation}`, sequence: resumed.sequence },
  }));
  await feed.until((f) => f.batches.some((b) => b.snapshotDone), 'the snapshot after a foreign cursor');
  assert.equal(feed.batches[0].lost, true);
  const all = [...k1, ...k2, ...k3].map((c) => hex(c.key)).sort();
  assert.deepEqual(keysOf(events(feed, 'stored', ns)).sort(), all, 'the snapshot is what is present');
  const point = feed.watch.cursor.sequence;
  assert.ok(point >= resumed.sequence + 1, 'the snapshot point is past k3');
  const k4 = chunksOf(2, 100);
  await client.store(ns, k4);
  await feed.until((f) => f.index.get(ns)?.has(hex(k4[1].key)), 'a live event after the snapshot');
  const live = feed.batches.slice(feed.batches.findIndex((b) => b.snapshotDone) + 1);
  assert.ok(live.every((b) => !b.lost && !b.snapshot && b.sequence > point), 'live from S + 1');
  assert.deepEqual(keysOf(live.flatMap((b) => b.events.filter((e) => e.kind === 'stored').map((e) => e.stored))).sort(),
    k4.map((c) => hex(c.key)).sort(), 'no gap, no duplicate');
  assert.deepEqual(feed.keys(ns), await present(client, ns, [...k1, ...k2, ...k3, ...k4].map((c) => c.key)));
  const kept = feed.watch.cursor;
  feed.watch.close();

  // 20 more events than the 16-event ring holds: the kept cursor was dropped.
  for (let i = 0; i < 20; i++) await client.store(uniq('other'), chunksOf(1, 10));
  feed = follow(client.watchEvents({ namespaces: [ns], cursor: kept }));
  t.after(() => feed.watch.close());
  await feed.until((f) => f.batches.some((b) => b.snapshotDone), 'the snapshot after a dropped cursor');
  assert.equal(feed.batches[0].lost, true, 'a cursor older than the ring is lost');
  assert.deepEqual(feed.keys(ns), await present(client, ns, [...k1, ...k2, ...k3, ...k4].map((c) => c.key)));
});

test('the stream ends with typed errors: NOT_SERVING, Unauthenticated, refused, aborted, killed', async (t) => {
  // A fatal failure: the watcher's stream ends with the server's error, not in silence.
  const server = await startServer({ failpoints: 'transfer.before_copy=raise' });
  const client = new kv.KVClient(server.address);
  t.after(async () => { client.close(); await server.stop(); });
  const feed = follow(client.watchEvents({}));
  await feed.until((f) => f.batches.some((b) => b.snapshotDone), 'the snapshot');
  await assert.rejects(client.store('ns', [{ key: 'k', data: 'v' }]), kv.FatalServerError);
  await feed.until((f) => f.error !== undefined, 'the end of the stream').catch(() => {});
  assert.ok(feed.error instanceof kv.ServiceNotServing, `ServiceNotServing, got ${feed.error}`);
  assert.equal(feed.error.remote, true, 'an error batch');
  assert.equal(feed.error.method, 'WatchEvents');

  // A wrong token.
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'kvsvc-node-events-'));
  t.after(() => fs.rmSync(dir, { recursive: true, force: true }));
  const token = crypto.randomBytes(16).toString('hex');
  const file = path.join(dir, 'tenants.json');
  fs.writeFileSync(file, JSON.stringify({ tenants: { a: { tokens: [token], namespaces: ['a/*'] } } }));
  const authed = await startServer({ args: ['--auth-token-file', file] });
  t.after(() => authed.stop());
  const wrong = new kv.KVClient(authed.address, { token: crypto.randomBytes(16).toString('hex') });
  const right = new kv.KVClient(authed.address, { token });
  t.after(() => { wrong.close(); right.close(); });
  await assert.rejects(wrong.watchEvents({}).next(), (e) => {
    assert.equal(e.constructor, kv.Unauthenticated);
    assert.equal(e.method, 'WatchEvents');
    return true;
  });
  const mine = follow(right.watchEvents({}));
  t.after(() => mine.watch.close());
  await mine.until((f) => f.batches.some((b) => b.snapshotDone), 'the tenant\'s snapshot');
  await right.store('a/x', [{ key: 'k', data: 'v' }]);
  await mine.until((f) => f.index.get('a/x')?.has(hex(Buffer.from('k'))), 'the tenant\'s own event');

  // Nothing listens: ServiceUnavailable (retryable).
  const refused = new kv.KVClient(await refusedAddress());
  t.after(() => refused.close());
  await assert.rejects(refused.watchEvents({}).next(), (e) => {
    assert.equal(e.constructor, kv.ServiceUnavailable);
    assert.equal(e.retryable, true);
    return true;
  });

  // An abort: Cancelled; a closed client refuses to open one.
  const ac = new AbortController();
  const w = right.watchEvents({ signal: ac.signal });
  await w.next(); // the lost batch
  setTimeout(() => ac.abort(), 50);
  await assert.rejects((async () => { for (;;) await w.next(); })(), kv.Cancelled);
  const closed = new kv.KVClient(authed.address, { token });
  closed.close();
  assert.throws(() => closed.watchEvents({}), kv.Cancelled);
  assert.throws(() => right.watchEvents({ cursor: { incarnation: 'x', sequence: -1 } }), TypeError);

  // kill -9: the stream ends with ServiceUnavailable; the next incarnation answers
  // the kept cursor with lost and a snapshot of what it holds, then live events.
  const kept = mine.watch.cursor;
  assert.ok(kept);
  authed.kill();
  await mine.until((f) => f.error !== undefined, 'the end of the stream after kill -9').catch(() => {});
  assert.equal(mine.error?.constructor, kv.ServiceUnavailable, `ServiceUnavailable, got ${mine.error}`);
  const next = await startServer();
  t.after(() => next.stop());
  const again = new kv.KVClient(next.address);
  t.after(() => again.close());
  await again.store('n', [{ key: 'before', data: 'v' }]);
  const resync = follow(again.watchEvents({ cursor: kept }));
  t.after(() => resync.watch.close());
  await resync.until((f) => f.batches.some((b) => b.snapshotDone), 'the snapshot of the new incarnation');
  assert.equal(resync.batches[0].lost, true, 'a cursor of the last incarnation is lost');
  assert.notEqual(resync.watch.cursor.incarnation, kept.incarnation);
  assert.deepEqual(resync.keys('n'), [hex(Buffer.from('before'))]);
  await again.store('n', [{ key: 'after', data: 'v' }]);
  await resync.until((f) => f.index.get('n')?.has(hex(Buffer.from('after'))), 'a live event');
});
