'use strict';
// The Session stream against real `kvsvc serve` processes: the same results as
// unary calls, many calls on one stream, a server killed mid-call, a deadline per
// request, unary calls to a server without the RPC, and the token.
const test = require('node:test');
const assert = require('node:assert/strict');
const { spawn } = require('node:child_process');
const crypto = require('node:crypto');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const kv = require('../src');
const { startServer } = require('./helpers/server');

const since = (t0) => (Date.now() - t0) / 1000;
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
const uniq = (prefix) => `${prefix}-${crypto.randomUUID()}`;

/** Map one rank with one uint8 tensor of 4 blocks of 64 bytes over file `name`. */
function mapRequest(namespace, name) {
  return {
    namespace,
    ranks: [{
      context: { tpSize: 1, ppSize: 1, groupId: 'g' },
      tensors: [{
        name: 'layer.0', handle: { sharedMemory: { name, sizeBytes: 256 } },
        shape: [4, 64], strides: [64, 1], dtype: 'DTYPE_UINT8', blockDim: 0,
      }],
    }],
  };
}

const blocks = (mappingId, chunks) => ({
  mappingId, chunks: chunks.map(([key, blockIds]) => ({ key: Buffer.from(key), blockIds })),
});

/** What a call gave, without the ids that differ from call to call. */
async function outcome(promise) {
  try {
    const r = await promise;
    const { transferId, serverStartId, ...rest } = r;
    return JSON.stringify(rest);
  } catch (e) {
    if (!(e instanceof kv.KVServiceError)) return `untyped ${e}`;
    return `${e.constructor.name} ${e.reason} ${e.transferState} remote=${e.remote}`;
  }
}

test('results are the same over the session and over unary calls', async (t) => {
  const server = await startServer();
  t.after(() => server.stop());
  const run = async (client, tag) => {
    const ns = uniq(`eq-${tag}`);
    const name = `eq-${tag}`;
    const content = Buffer.alloc(256);
    for (let i = 0; i < 256; i++) content[i] = (i * 7) & 0xff;
    fs.writeFileSync(path.join(server.shmDir, name), content);
    const m = await client.call('Map', mapRequest(ns, name));
    const out = [];
    const add = async (p) => out.push(await outcome(p));
    await add(client.store(ns, [{ key: 'a', data: Buffer.alloc(100, 65) }, { key: 'b', data: 'bee' }]));
    await add(client.store(ns, [{ key: 'a', data: 'again' }]));
    await add(client.lookup(ns, ['a', 'b', 'c']));
    await add(client.lookup(ns, ['c', 'a']));
    await add(client.retrieve(ns, ['a', 'b', 'zz', 'a']));
    await add(client.lookup('', ['a'])); // InvalidRequest
    await add(client.lookup({ mappingId: 'nope' }, ['a'])); // MappingLost
    await add(client.call('Store', { blocks: blocks(m.mappingId, [['blk', [0, 1]]]) }));
    await add(client.lookup({ mappingId: m.mappingId }, ['blk', 'a']));
    await add(client.call('Retrieve', { blocks: blocks(m.mappingId, [['blk', [2, 3]]]) }));
    await add(client.call('Retrieve', { blocks: blocks('gone', [['blk', [2, 3]]]) }));
    await add(client.fence({ mappingId: m.mappingId }));
    await add(client.fence({ transferIds: [uniq('never-seen')] }));
    await add(client.call('Store', {})); // unset oneof: UnsupportedRequest
    const after = fs.readFileSync(path.join(server.shmDir, name));
    out.push(`blocks 2..3 = blocks 0..1: ${after.subarray(128).equals(content.subarray(0, 128))}`);
    await client.call('Unmap', { mappingId: m.mappingId });
    return out;
  };
  const sc = new kv.KVClient(server.address);
  const uc = new kv.KVClient(server.address, { session: false });
  t.after(() => { sc.close(); uc.close(); });
  const viaSession = await run(sc, 's');
  const session = sc._session;
  const viaUnary = await run(uc, 'u');
  assert.deepEqual(viaSession, viaUnary);
  assert.match(viaSession.at(-1), /true$/, 'the block round trip moved the bytes');
  assert.equal(session.sent, 14, 'the session carried every Lookup/Store/Retrieve/Fence');
  assert.ok(sc.useSession);
  assert.equal(uc._session, null, 'session: false opened none');
  assert.throws(() => new kv.KVClient(server.address, { session: 'no' }), TypeError);
});

test('many calls at once on one session each get their own answer', async (t) => {
  // A slow Fence stays pending while every other answer overtakes it.
  const server = await startServer({ failpoints: 'handler.enter=Fence@sleep(6000)' });
  const client = new kv.KVClient(server.address);
  t.after(async () => { client.close(); await server.stop(); });
  const ns = uniq('many');
  const t0 = Date.now();
  let fenceDone = false;
  const fence = client.fence({ transferIds: [uniq('f')] }).finally(() => { fenceDone = true; });
  const n = 64;
  await Promise.all(Array.from({ length: n }, async (_, i) => {
    const key = `key-${i}`;
    const data = Buffer.alloc(100 + i, i);
    await client.store(ns, [{ key, data }]);
    assert.equal((await client.lookup(ns, [key, `none-${i}`])).hitChunks, 1);
    const got = await client.retrieve(ns, [key]);
    assert.equal(got.chunks.length, 1);
    assert.equal(got.chunks[0].key.toString(), key, "another call's answer");
    assert.ok(got.chunks[0].data.equals(data));
  }));
  const session = client._session;
  if (since(t0) < 5) assert.equal(fenceDone, false, 'the slow Fence ended before the others');
  await fence;
  assert.equal(client._session, session);
  assert.equal(session.sent, 3 * n + 1, 'one session carried every call');
  assert.equal(session.failure, null);
});

test('a server killed mid-call ends every pending call at once; the next call opens a new stream', async (t) => {
  const server = await startServer({
    failpoints: 'transfer.copy=sleep(20000);handler.enter=Lookup@sleep(20000)',
  });
  const client = new kv.KVClient(server.address);
  let again = null;
  t.after(async () => { client.close(); await server.stop(); await again?.stop(); });
  fs.writeFileSync(path.join(server.shmDir, 'r'), crypto.randomBytes(256));
  const m = await client.call('Map', mapRequest(uniq('ns-kill'), 'r'));
  const rid = uniq('killed');
  // Two chunks: transfer.copy (after the first chunk) holds the copy in its middle.
  const store = client.call('Store', {
    header: { requestId: rid }, blocks: blocks(m.mappingId, [['x', [1]], ['y', [2]]]),
  }, { deadline: 60 });
  const lookup = client.lookup('ns', ['k'], { deadline: 60 });
  store.catch(() => {});
  lookup.catch(() => {});
  const end = Date.now() + 30_000;
  while ((await client.serverInfo()).inflightTransfers < 1) {
    assert.ok(Date.now() < end, 'the copy never started');
    await sleep(20);
  }
  await sleep(1000); // the Lookup reached the server too
  const t0 = Date.now();
  server.kill();
  await assert.rejects(store, (e) => {
    assert.equal(e.constructor, kv.TransferUnprovable);
    assert.equal(e.transferState, 'UNKNOWN');
    assert.equal(e.buffersReusable, false);
    assert.equal(e.requestId, rid);
    assert.equal(e.code, 'UNAVAILABLE');
    assert.match(e.message, /session stream broke/);
    return true;
  });
  await assert.rejects(lookup, (e) => {
    assert.equal(e.constructor, kv.ServiceUnavailable);
    assert.equal(e.retryable, true);
    assert.match(e.message, /session stream broke/);
    return true;
  });
  assert.ok(since(t0) < 10, `took ${since(t0)} s: not at once (the deadlines were 60 s)`);
  const broken = client._session;
  // The next call opens a new stream: to nothing, it provably did not start...
  await assert.rejects(client.call('Store', { blocks: blocks(m.mappingId, [['z', [3]]]) }, { deadline: 10 }),
    (e) => e instanceof kv.ServiceUnavailable && e.transferState === 'NOT_STARTED');
  // ...and to a server back on the same address, it works.
  again = await startServer({ args: ['--listen', server.address] });
  for (;;) {
    try {
      await client.store('ns', [{ key: 'k', data: 'v' }], { deadline: 5 });
      break;
    } catch (e) {
      if (!(e instanceof kv.ServiceUnavailable) || Date.now() > end + 30_000) throw e;
      await sleep(200); // the channel's reconnect backoff
    }
  }
  assert.equal((await client.lookup('ns', ['k'])).hitChunks, 1);
  assert.notEqual(client._session, broken);
  assert.equal(client._session.failure, null);
});

test('each request has its own deadline; the others on the stream go on', async (t) => {
  const server = await startServer({ failpoints: 'handler.enter=Lookup@hang' });
  const client = new kv.KVClient(server.address);
  t.after(async () => { client.close(); await server.stop(); });
  await client.store('ns', [{ key: 'k', data: 'v' }]);
  const session = client._session;
  const t0 = Date.now();
  let hungDone = false;
  const hung = client.lookup('ns', ['k'], { deadline: 3 }).finally(() => { hungDone = true; });
  hung.catch(() => {});
  for (let i = 0; i < 5; i++) {
    const got = await client.retrieve('ns', ['k']);
    assert.equal(got.chunks[0].data.toString(), 'v');
  }
  if (since(t0) < 2.5) assert.equal(hungDone, false, 'the Lookup ended before its deadline');
  await assert.rejects(hung, (e) => {
    assert.equal(e.constructor, kv.DeadlineExceeded);
    assert.equal(e.code, 'DEADLINE_EXCEEDED');
    assert.equal(e.reason, 'TRANSPORT_DEADLINE_EXCEEDED');
    assert.equal(e.remote, false);
    return true;
  });
  const took = since(t0);
  assert.ok(took >= 2.9 && took < 6, `took ${took} s for a 3 s deadline`);
  // An aborted signal ends only its own request.
  const ac = new AbortController();
  setTimeout(() => ac.abort(), 200);
  await assert.rejects(client.lookup('ns', ['k'], { signal: ac.signal }), kv.Cancelled);
  await client.fence({ transferIds: [uniq('f')] });
  assert.equal(client._session, session, 'the deadline did not break the session');
  assert.equal(session.failure, null);
  // Closing the client ends a pending call at once, as Cancelled.
  const pending = client.lookup('ns', ['k'], { deadline: 30 });
  await sleep(300);
  const t1 = Date.now();
  client.close();
  await assert.rejects(pending, (e) => e instanceof kv.Cancelled && e.code === 'CANCELLED');
  assert.ok(since(t1) < 3);
});

test('an idle session is closed: the next call opens another, and a forgotten client lets node exit', async (t) => {
  const server = await startServer();
  t.after(() => server.stop());
  const client = new kv.KVClient(server.address);
  t.after(() => client.close());
  await client.store('ns', [{ key: 'k', data: 'v' }]);
  const first = client._session;
  await sleep(2500);
  assert.ok(first.failure, 'the idle session was closed');
  assert.equal((await client.lookup('ns', ['k'])).hitChunks, 1);
  assert.notEqual(client._session, first);
  // A script that never calls close() still ends (an open stream would hold node).
  const script = `const kv = require(${JSON.stringify(path.resolve(__dirname, '..', 'src'))});
    const c = new kv.KVClient(${JSON.stringify(server.address)});
    c.lookup('ns', ['k']).then((r) => console.log('hits', r.hitChunks));`;
  const child = spawn(process.execPath, ['-e', script], { stdio: ['ignore', 'pipe', 'inherit'] });
  let out = '';
  child.stdout.on('data', (b) => { out += b; });
  const t0 = Date.now();
  const exited = await Promise.race([
    new Promise((resolve) => child.once('exit', (code) => resolve(code))),
    sleep(20_000).then(() => 'running'),
  ]);
  if (exited === 'running') child.kill('SIGKILL');
  assert.equal(exited, 0, `node did not exit (${since(t0)} s)`);
  assert.match(out, /hits 1/);
});

test('a server without the Session RPC gets unary calls', async (t) => {
  const server = await startServer({ withoutSession: true });
  const client = new kv.KVClient(server.address);
  const fresh = new kv.KVClient(server.address);
  t.after(async () => { client.close(); fresh.close(); await server.stop(); });
  fs.writeFileSync(path.join(server.shmDir, 'r'), crypto.randomBytes(256));
  const m = await client.call('Map', mapRequest(uniq('ns-old'), 'r'));
  // The first call that would use the session: a block transfer, sent unary instead.
  const st = await client.call('Store', { blocks: blocks(m.mappingId, [['b', [0, 1]]]) });
  assert.equal(st.storedBytes, 128);
  assert.equal(client.useSession, false);
  // The server may send (empty) headers before UNIMPLEMENTED, so a request can
  // have been written; none ran, and each was answered by its unary call.
  assert.equal(client._session.failure.code, 12, 'the refused session ended UNIMPLEMENTED (12)');
  assert.equal((await client.lookup({ mappingId: m.mappingId }, ['b'])).hitChunks, 1);
  await client.fence({ mappingId: m.mappingId });
  // Many calls at once before any answer: each goes unary.
  const hits = await Promise.all(Array.from({ length: 8 }, () => fresh.lookup({ mappingId: m.mappingId }, ['b'])));
  assert.deepEqual(hits.map((h) => h.hitChunks), Array(8).fill(1));
  assert.equal(fresh.useSession, false);
});

test('the session carries the token; a wrong one is Unauthenticated', async (t) => {
  const token = crypto.randomBytes(16).toString('hex');
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'kvsvc-node-sess-auth-'));
  const file = path.join(dir, 'tenants.json');
  fs.writeFileSync(file, JSON.stringify({ tenants: { a: { tokens: [token], namespaces: ['*'] } } }));
  const server = await startServer({ args: ['--auth-token-file', file] });
  t.after(async () => { await server.stop(); fs.rmSync(dir, { recursive: true, force: true }); });
  const good = new kv.KVClient(server.address, { token });
  t.after(() => good.close());
  await good.store('ns', [{ key: 'k', data: 'v' }]);
  assert.equal((await good.lookup('ns', ['k'])).hitChunks, 1);
  assert.equal(good._session.sent, 2);
  for (const bad of [undefined, crypto.randomBytes(16).toString('hex')]) {
    const c = new kv.KVClient(server.address, { token: bad });
    try {
      for (let i = 0; i < 2; i++) { // and again on a new stream
        await assert.rejects(c.lookup('ns', ['k']),
          (e) => e instanceof kv.Unauthenticated && e.code === 'UNAUTHENTICATED');
        await assert.rejects(c.retrieve('ns', ['k']), kv.Unauthenticated);
        // Refused before any handler ran: a block transfer's buffers are free.
        await assert.rejects(c.call('Store', { blocks: blocks('m', [['k', [0]]]) }),
          (e) => e instanceof kv.Unauthenticated && e.transferState === 'NOT_STARTED');
      }
      assert.equal(c.useSession, true, 'UNAUTHENTICATED did not turn the session off');
    } finally {
      c.close();
    }
  }
});
