'use strict';
// Lookup latency at one caller, over the session and over unary calls, against a
// real `kvsvc serve` (KVSVC_BIN as for the tests): node bench/lookup.js [calls]
// One session Lookup and one unary Lookup alternate (same keys, same server, same
// moment; which goes first alternates too); prints each one's p50 and p99.
const kv = require('../src');
const { startServer } = require('../test/helpers/server');

const pct = (sorted, p) => sorted[Math.min(sorted.length - 1, Math.floor(sorted.length * p))];

(async () => {
  const calls = Number(process.argv[2] ?? 3000);
  const server = await startServer();
  const session = new kv.KVClient(server.address);
  const unary = new kv.KVClient(server.address, { session: false });
  try {
    const ns = `bench-${process.pid}`;
    const keys = ['k0', 'k1', 'k2', 'k3'];
    await session.store(ns, [{ key: 'k0', data: Buffer.alloc(1024) }, { key: 'k1', data: Buffer.alloc(1024) }]);
    for (let i = 0; i < 200; i++) { // warm both paths
      await session.lookup(ns, keys);
      await unary.lookup(ns, keys);
    }
    const lat = { session: [], unary: [] };
    for (let i = 0; i < calls; i++) {
      const order = i % 2 ? [['unary', unary], ['session', session]] : [['session', session], ['unary', unary]];
      for (const [mode, client] of order) {
        const t0 = process.hrtime.bigint();
        const r = await client.lookup(ns, keys);
        lat[mode].push(Number(process.hrtime.bigint() - t0) / 1000);
        if (r.hitChunks !== 2) throw new Error(`hitChunks ${r.hitChunks}`);
      }
    }
    for (const [mode, xs] of Object.entries(lat)) {
      xs.sort((a, b) => a - b);
      console.log(`node Lookup ${mode}: p50 ${pct(xs, 0.5).toFixed(0)} µs, p99 ${pct(xs, 0.99).toFixed(0)} µs (${xs.length} calls, 1 caller)`);
    }
  } finally {
    session.close();
    unary.close();
    await server.stop();
  }
})().catch((e) => { console.error(e); process.exitCode = 1; });
