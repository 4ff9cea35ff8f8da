'use strict';
// Deadlines (validation, defaults, expiry), cancellation and transport failures.
const test = require('node:test');
const assert = require('node:assert/strict');
const crypto = require('node:crypto');
const fs = require('node:fs');
const path = require('node:path');
const kv = require('../src');
const { startServer, refusedAddress } = require('./helpers/server');

/** Seconds since t0 (a Date.now() value). */
const since = (t0) => (Date.now() - t0) / 1000;

test('deadline settings must be finite numbers > 0; the error names the setting', async () => {
  for (const setting of ['transferDeadline', 'controlDeadline']) {
    for (const bad of [0, -1, NaN, Infinity, -Infinity]) {
      assert.throws(() => new kv.KVClient('127.0.0.1:1', { [setting]: bad }),
        (e) => e instanceof RangeError && e.message.includes(setting), `${setting}=${bad}`);
    }
    for (const bad of ['5', null, true, 5n, {}]) {
      assert.throws(() => new kv.KVClient('127.0.0.1:1', { [setting]: bad }),
        (e) => e instanceof TypeError && e.message.includes(setting), `${setting}=${String(bad)}`);
    }
  }
  const c = new kv.KVClient(await refusedAddress());
  try {
    assert.equal(c.transferDeadline, 30);
    assert.equal(c.controlDeadline, 5);
    // A bad per-call deadline is refused before anything is sent (not ServiceUnavailable).
    await assert.rejects(c.lookup('ns', ['k'], { deadline: 0 }),
      (e) => e instanceof RangeError && /deadline must be finite and > 0/.test(e.message));
    await assert.rejects(c.store('ns', [{ key: 'k', data: 'd' }], { deadline: Infinity }), RangeError);
    await assert.rejects(c.serverInfo({ deadline: '1' }),
      (e) => e instanceof TypeError && e.message.startsWith('deadline'));
    await assert.rejects(c.healthCheck('', { deadline: -0.5 }), RangeError);
  } finally {
    c.close();
  }
});

test('connection refused -> ServiceUnavailable (retryable, never TransferUnprovable)', async () => {
  const c = new kv.KVClient(await refusedAddress());
  try {
    const t0 = Date.now();
    const attempts = {
      Lookup: () => c.lookup('ns', ['k']),
      GetServerInfo: () => c.serverInfo(),
      Store: () => c.store('ns', [{ key: 'k', data: 'd' }]),
      'Health.Check': () => c.healthCheck(),
    };
    for (const [method, attempt] of Object.entries(attempts)) {
      await assert.rejects(attempt(), (e) => {
        assert.equal(e.constructor, kv.ServiceUnavailable, method);
        assert.equal(e.code, 'UNAVAILABLE');
        assert.equal(e.reason, 'TRANSPORT_UNAVAILABLE');
        assert.equal(e.retryable, true);
        assert.equal(e.remote, false);
        assert.equal(e.method, method);
        assert.match(e.message, /ECONNREFUSED|connect/i);
        return true;
      });
    }
    // A copy between mapped blocks that could not even be sent provably did not start.
    await assert.rejects(c.call('Store', {
      blocks: { mappingId: 'm', chunks: [{ key: Buffer.from('k'), blockIds: [0] }] },
    }), (e) => {
      assert.equal(e.constructor, kv.ServiceUnavailable);
      assert.equal(e.transferState, 'NOT_STARTED');
      assert.equal(e.buffersReusable, true);
      assert.match(e.requestId, /^[0-9a-f]{32}$/);
      return true;
    });
    assert.ok(since(t0) < 10, 'fails fast, not at the 30 s deadline');
  } finally {
    c.close();
  }
});

test('against a slow server', async (t) => {
  const server = await startServer({
    // Each sleep outlasts the deadline it races by seconds (a loaded CI host).
    failpoints: 'handler.enter=Lookup@sleep(4000);transfer.before_copy=sleep(5000)',
    args: ['--store-bytes', '64K'],
  });
  const client = new kv.KVClient(server.address);
  t.after(async () => {
    client.close();
    await server.stop();
  });

  await t.test('Lookup with a 0.3 s deadline -> DeadlineExceeded at 0.3 s', async () => {
    const t0 = Date.now();
    await assert.rejects(client.lookup('ns', ['k'], { deadline: 0.3 }), (e) => {
      assert.equal(e.constructor, kv.DeadlineExceeded);
      assert.equal(e.code, 'DEADLINE_EXCEEDED');
      assert.equal(e.reason, 'TRANSPORT_DEADLINE_EXCEEDED');
      assert.equal(e.remote, false);
      assert.equal(e.transferState, 'UNSPECIFIED');
      assert.match(e.requestId, /^[0-9a-f]{32}$/);
      return true;
    });
    const took = since(t0);
    assert.ok(took >= 0.25 && took < 3.5, `took ${took} s`);
  });

  await t.test('an aborted signal cancels the call -> Cancelled', async () => {
    const ac = new AbortController();
    setTimeout(() => ac.abort(), 200);
    const t0 = Date.now();
    await assert.rejects(client.lookup('ns', ['k'], { signal: ac.signal }), (e) => {
      assert.equal(e.constructor, kv.Cancelled);
      assert.equal(e.code, 'CANCELLED');
      return true;
    });
    assert.ok(since(t0) < 3.5, 'at the abort, not at the 5 s control deadline');
    await assert.rejects(client.lookup('ns', ['k'], { signal: ac.signal }),
      (e) => e instanceof kv.Cancelled && /before it was sent/.test(e.message));
  });

  await t.test('a chunk larger than the store -> CapacityExhausted, not retryable', async () => {
    await assert.rejects(client.store('ns', [{ key: 'big', data: Buffer.alloc(100 * 1024) }]), (e) => {
      assert.equal(e.constructor, kv.CapacityExhausted);
      assert.equal(e.code, 'RESOURCE_EXHAUSTED');
      assert.equal(e.reason, 'REQUEST_EXCEEDS_CAPACITY');
      assert.equal(e.retryable, false);
      assert.ok(Number(e.metadata.requestBytes) > 100 * 1024);
      assert.equal(e.transferState, 'NOT_STARTED');
      return true;
    });
  });

  await t.test('the transfer deadline default applies to an inline Store', async () => {
    const short = new kv.KVClient(server.address, { transferDeadline: 1.5 });
    try {
      await short.serverInfo(); // connected: the copy must start within the deadline
      const rid = `slow-${crypto.randomUUID()}`;
      const t0 = Date.now();
      await assert.rejects(short.store('ns-slow', [{ key: 'k', data: 'v' }], { requestId: rid }), (e) => {
        assert.equal(e.constructor, kv.DeadlineExceeded);
        assert.equal(e.requestId, rid);
        return true;
      });
      const took = since(t0);
      assert.ok(took >= 1.4 && took < 4.5, `took ${took} s for a 1.5 s default`);
      // The copy outlived its call; Fence proves it ended, and it was stored.
      await client.fence({ transferIds: [rid] }, { deadline: 20 });
      assert.equal((await client.lookup('ns-slow', ['k'], { deadline: 15 })).hitChunks, 1);
    } finally {
      short.close();
    }
  });

  await t.test('a block Store whose reply is lost -> TransferUnprovable, until a Fence', async () => {
    fs.writeFileSync(path.join(server.shmDir, 'r'), crypto.randomBytes(256));
    const ns = `ns-unprovable-${crypto.randomUUID()}`;
    const mapped = await client.call('Map', {
      namespace: ns,
      ranks: [{
        context: { tpSize: 1, ppSize: 1 },
        tensors: [{
          name: 'l0', handle: { sharedMemory: { name: 'r', sizeBytes: 256 } },
          shape: [4, 64], strides: [64, 1], dtype: 'DTYPE_UINT8', blockDim: 0,
        }],
      }],
    });
    const rid = `blk-${crypto.randomUUID()}`;
    const t0 = Date.now();
    await assert.rejects(client.call('Store', {
      header: { requestId: rid },
      blocks: { mappingId: mapped.mappingId, chunks: [{ key: Buffer.from('b'), blockIds: [0, 1] }] },
    }, { deadline: 1.5 }), (e) => {
      assert.equal(e.constructor, kv.TransferUnprovable);
      assert.equal(e.code, 'DEADLINE_EXCEEDED');
      assert.equal(e.reason, 'TRANSFER_UNPROVABLE');
      assert.equal(e.transferState, 'UNKNOWN');
      assert.equal(e.buffersReusable, false);
      assert.equal(e.requestId, rid, 'the transfer id to fence');
      assert.equal(e.metadata.grpcCode, 'DEADLINE_EXCEEDED');
      return true;
    });
    assert.ok(since(t0) < 4.5, 'at the deadline, not when the 5 s copy ends');
    const fenced = await client.fence({ transferIds: [rid] }, { deadline: 20 });
    assert.equal(fenced.barredTransfers, 0, 'the server had seen the transfer');
    assert.equal((await client.lookup({ mappingId: mapped.mappingId }, ['b'], { deadline: 15 })).hitChunks, 1);
    await client.call('Unmap', { mappingId: mapped.mappingId });
  });
});
