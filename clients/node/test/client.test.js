'use strict';
// Against one real `kvsvc serve`: the round trip, health, and every error the
// server raises for requests it refuses.
const test = require('node:test');
const assert = require('node:assert/strict');
const crypto = require('node:crypto');
const fs = require('node:fs');
const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const kv = require('../src');
const { startServer } = require('./helpers/server');

let server;
let client;

test.before(async () => {
  server = await startServer();
  client = new kv.KVClient(server.address);
});

test.after(async () => {
  client?.close();
  await server?.stop();
});

/** Map one rank with one uint8 tensor of `blocks` blocks of 64 bytes over file `name`. */
function mapRequest(namespace, name, blocks = 4) {
  return {
    namespace,
    ranks: [{
      context: { tpRank: 0, tpSize: 1, ppRank: 0, ppSize: 1, groupId: 'g' },
      tensors: [{
        name: 'layer.0',
        handle: { sharedMemory: { name, sizeBytes: blocks * 64 } },
        offsetBytes: 0,
        shape: [blocks, 64],
        strides: [64, 1],
        dtype: 'DTYPE_UINT8',
        blockDim: 0,
      }],
    }],
  };
}

test('store -> lookup -> retrieve round trip is bit-exact', async () => {
  const ns = `rt-${crypto.randomUUID()}`;
  const chunks = [0, 1, 2].map((i) => ({
    key: crypto.randomBytes(16),
    data: crypto.randomBytes(1000 + i * 4096), // every byte value, odd sizes
  }));
  chunks[1].data[0] = 0; // leading zero bytes survive
  const stored = await client.store(ns, chunks);
  assert.equal(stored.storedChunks, 3);
  assert.equal(stored.presentChunks, 0);
  assert.equal(stored.storedBytes, chunks.reduce((n, c) => n + c.data.length, 0));
  assert.match(stored.transferId, /^[0-9a-f]{32}$/);
  assert.ok(stored.serverStartId);

  const keys = chunks.map((c) => c.key);
  const missing = crypto.randomBytes(16);
  assert.equal((await client.lookup(ns, keys)).hitChunks, 3);
  assert.equal((await client.lookup({ namespace: ns }, [keys[0], missing, keys[1]])).hitChunks, 1);
  assert.equal((await client.lookup(`${ns}-other`, keys)).hitChunks, 0);

  const got = await client.retrieve(ns, [...keys, missing, keys[0]]);
  assert.equal(got.loadedChunks, 3, 'loading stops at the first miss');
  assert.equal(got.chunks.length, 3);
  for (let i = 0; i < 3; i++) {
    assert.ok(got.chunks[i].key.equals(keys[i]));
    assert.ok(got.chunks[i].data.equals(chunks[i].data), `chunk ${i} differs`);
  }
  assert.equal(got.loadedBytes, stored.storedBytes);

  const again = await client.store(ns, chunks);
  assert.equal(again.storedChunks, 0);
  assert.equal(again.presentChunks, 3);
});

test('server info reports version, usage and health', async () => {
  const info = await client.serverInfo();
  assert.equal(info.envelopeVersion, 1);
  assert.equal(info.serving, true);
  assert.equal(info.failureReason, '');
  assert.equal(info.failureTime, null);
  assert.ok(info.startTime instanceof Date);
  assert.ok(Math.abs(info.startTime.getTime() - Date.now()) < 10 * 60_000);
  assert.ok(info.capacityBytes > 0);
  assert.equal(typeof info.version, 'string');
  assert.ok(info.version.length > 0);
  assert.equal(info.device, 'cpu');
});

test('health check: "" and the service name are SERVING; an unknown name is NotFound', async () => {
  assert.equal(await client.healthCheck(), 'SERVING');
  assert.equal(await client.healthCheck(''), 'SERVING');
  assert.equal(await client.healthCheck(kv.HEALTH_SERVICE_NAME), 'SERVING');
  await assert.rejects(client.healthCheck('no.such.Service'), (e) => {
    assert.ok(e instanceof kv.NotFound);
    assert.equal(e.reason, 'TRANSPORT_NOT_FOUND');
    assert.equal(e.code, 'NOT_FOUND');
    assert.equal(e.remote, false);
    return true;
  });
});

test('empty namespace -> InvalidRequest, with the field named', async () => {
  for (const attempt of [
    () => client.store('', [{ key: 'k', data: 'd' }]),
    () => client.retrieve('', ['k']),
  ]) {
    await assert.rejects(attempt(), (e) => {
      assert.equal(e.constructor, kv.InvalidRequest);
      assert.ok(e instanceof kv.KVServiceError);
      assert.equal(e.code, 'INVALID_ARGUMENT');
      assert.equal(e.reason, 'INVALID_ARGUMENT');
      assert.deepEqual(e.metadata, { field: 'namespace' });
      assert.equal(e.transferState, 'NOT_STARTED');
      assert.equal(e.remote, true);
      assert.match(e.requestId, /^[0-9a-f]{32}$/);
      assert.equal(e.retryable, false);
      return true;
    });
  }
});

test('empty key -> InvalidRequest naming the key index', async () => {
  await assert.rejects(client.store('ns', [{ key: 'a', data: 'x' }, { key: '', data: 'y' }]), (e) => {
    assert.equal(e.constructor, kv.InvalidRequest);
    assert.equal(e.metadata.keyIndex, '1');
    return true;
  });
});

test('a request whose oneof is unset -> UnsupportedRequest', async () => {
  for (const [method, field] of [['Store', 'source'], ['Retrieve', 'target'], ['Lookup', 'scope']]) {
    await assert.rejects(client.call(method, {}), (e) => {
      assert.equal(e.constructor, kv.UnsupportedRequest, method);
      assert.ok(e instanceof kv.InvalidRequest);
      assert.equal(e.reason, 'UNSUPPORTED_REQUEST');
      assert.equal(e.metadata.field, field);
      assert.equal(e.method, method);
      return true;
    });
  }
});

test('envelope version 99 -> UnsupportedRequest UNSUPPORTED_ENVELOPE_VERSION', async () => {
  const req = { header: { envelopeVersion: 99 }, namespace: 'ns', keys: [Buffer.from('k')] };
  await assert.rejects(client.call('Lookup', req), (e) => {
    assert.equal(e.constructor, kv.UnsupportedRequest);
    assert.equal(e.reason, 'UNSUPPORTED_ENVELOPE_VERSION');
    assert.equal(e.type, 'UnsupportedRequest');
    assert.equal(e.metadata.envelopeVersion, '99');
    assert.equal(e.metadata.supported, '1');
    return true;
  });
});

test('Lookup/Unmap/Fence of mapping "nope" -> MappingLost', async () => {
  for (const attempt of [
    () => client.lookup({ mappingId: 'nope' }, ['k']),
    () => client.call('Unmap', { mappingId: 'nope' }),
    () => client.fence({ mappingId: 'nope' }),
  ]) {
    await assert.rejects(attempt(), (e) => {
      assert.equal(e.constructor, kv.MappingLost);
      assert.ok(e instanceof kv.NotFound);
      assert.equal(e.reason, 'MAPPING_NOT_FOUND');
      assert.equal(e.metadata.mappingId, 'nope');
      assert.ok(e.metadata.serverStartId);
      return true;
    });
  }
});

test('the request id the caller chooses is the transfer id; reusing it is refused', async () => {
  const rid = `rid-${crypto.randomUUID()}`;
  const r = await client.store('ns-rid', [{ key: 'k', data: 'v' }], { requestId: rid });
  assert.equal(r.transferId, rid);
  await assert.rejects(client.store('ns-rid', [{ key: 'k2', data: 'v' }], { requestId: rid }), (e) => {
    assert.equal(e.constructor, kv.InvalidRequest);
    assert.equal(e.reason, 'DUPLICATE_TRANSFER_ID');
    assert.equal(e.requestId, rid);
    assert.equal(e.transferState, 'NOT_STARTED');
    return true;
  });
});

test('Fence bars a transfer id it has not seen; that transfer never runs', async () => {
  const tid = `late-${crypto.randomUUID()}`;
  const f = await client.fence({ transferIds: [tid] });
  assert.equal(f.barredTransfers, 1);
  assert.equal(f.waitedTransfers, 0);
  await assert.rejects(client.store('ns-fence', [{ key: 'k', data: 'v' }], { requestId: tid }), (e) => {
    assert.equal(e.constructor, kv.InvalidRequest);
    assert.equal(e.reason, 'TRANSFER_BARRED');
    assert.equal(e.transferState, 'NOT_STARTED');
    return true;
  });
  assert.equal((await client.lookup('ns-fence', ['k'])).hitChunks, 0);
});

test('tensors beyond their handle -> InvalidRequest TENSOR_OUT_OF_BOUNDS', async () => {
  const req = mapRequest('ns-oob', 'oob');
  req.ranks[0].tensors[0].handle.sharedMemory.sizeBytes = 100;
  await assert.rejects(client.call('Map', req), (e) => {
    assert.equal(e.constructor, kv.InvalidRequest);
    assert.equal(e.reason, 'TENSOR_OUT_OF_BOUNDS');
    assert.equal(e.metadata.endBytes, '256');
    return true;
  });
});

test('a region truncated by its owner after Map -> RegionUnavailable, copy FINISHED', async () => {
  const file = path.join(server.shmDir, 'shrinks');
  fs.writeFileSync(file, crypto.randomBytes(256));
  const mapped = await client.call('Map', mapRequest(`ns-trunc-${crypto.randomUUID()}`, 'shrinks'));
  try {
    fs.truncateSync(file, 0);
    await assert.rejects(client.call('Store', {
      blocks: { mappingId: mapped.mappingId, chunks: [{ key: Buffer.from('t'), blockIds: [3] }] },
    }), (e) => {
      assert.equal(e.constructor, kv.RegionUnavailable);
      assert.equal(e.code, 'FAILED_PRECONDITION');
      assert.equal(e.reason, 'REGION_TRUNCATED');
      assert.equal(e.metadata.name, 'shrinks');
      assert.equal(e.transferState, 'FINISHED');
      assert.equal(e.buffersReusable, true);
      return true;
    });
    assert.equal(await client.healthCheck(), 'SERVING', 'a client fault is not fatal');
  } finally {
    await client.call('Unmap', { mappingId: mapped.mappingId });
  }
});

test('a region that never appears -> DeadlineExceeded at the control deadline', async () => {
  const short = new kv.KVClient(server.address, { controlDeadline: 3 });
  try {
    const t0 = Date.now();
    await assert.rejects(short.call('Map', mapRequest('ns-missing', 'never-created')), (e) => {
      assert.equal(e.constructor, kv.DeadlineExceeded);
      // The server retries until just before the deadline; on a loaded host its
      // REGION_NOT_READY reply can land after it, and gRPC's own error wins.
      // Either way the caller gets a typed DeadlineExceeded at the deadline.
      if (e.remote) {
        assert.equal(e.reason, 'REGION_NOT_READY');
      } else {
        assert.equal(e.reason, 'TRANSPORT_DEADLINE_EXCEEDED');
      }
      return true;
    });
    const took = Date.now() - t0;
    assert.ok(took >= 1500 && took < 7000, `took ${took} ms for a 3 s deadline`);
  } finally {
    short.close();
  }
});

test('a chunk stored inline is a miss for a mapping, never its bytes', async () => {
  const ns = `ns-layout-${crypto.randomUUID()}`;
  const file = path.join(server.shmDir, 'region');
  const bytes = crypto.randomBytes(256);
  fs.writeFileSync(file, bytes);
  const mapped = await client.call('Map', mapRequest(ns, 'region'));
  assert.equal(mapped.numBlocks, 4);
  assert.equal(mapped.blockBytes, 64);
  try {
    // Blocks 1..2 go into the store under one key and come back into blocks 2..3.
    const stored = await client.call('Store', {
      blocks: { mappingId: mapped.mappingId, chunks: [{ key: Buffer.from('blk'), blockIds: [1, 2] }] },
    });
    assert.equal(stored.storedBytes, 128);
    assert.equal((await client.lookup({ mappingId: mapped.mappingId }, ['blk'])).hitChunks, 1);
    await client.call('Retrieve', {
      blocks: { mappingId: mapped.mappingId, chunks: [{ key: Buffer.from('blk'), blockIds: [2, 3] }] },
    });
    assert.ok(fs.readFileSync(file).subarray(128, 256).equals(bytes.subarray(64, 192)));

    await client.store(ns, [{ key: 'inline-key', data: Buffer.alloc(64, 7) }]);
    assert.equal((await client.lookup({ mappingId: mapped.mappingId }, ['inline-key'])).hitChunks, 0);
    assert.equal((await client.lookup(ns, ['inline-key'])).hitChunks, 1);
    // Presence is per (namespace, key, layout): the inline chunk ends the prefix.
    const before = fs.readFileSync(file);
    const got = await client.call('Retrieve', {
      blocks: { mappingId: mapped.mappingId, chunks: [{ key: Buffer.from('inline-key'), blockIds: [0] }] },
    });
    assert.equal(got.loadedChunks, 0);
    assert.ok(fs.readFileSync(file).equals(before), 'no block was written');
  } finally {
    const un = await client.call('Unmap', { mappingId: mapped.mappingId });
    assert.equal(un.fencedTransfers, 0);
  }
  await assert.rejects(client.lookup({ mappingId: mapped.mappingId }, ['blk']), kv.MappingLost);
});

test('a method the server does not have -> Unimplemented', async () => {
  const raw = new grpc.Client(server.address, grpc.credentials.createInsecure());
  try {
    const err = await new Promise((resolve) => {
      raw.makeUnaryRequest('/kvsvc.v1.KVCacheService/NoSuchMethod', (b) => b, (b) => b,
        Buffer.alloc(0), { deadline: Date.now() + 5000 }, (e) => resolve(e));
    });
    const e = kv.fromGrpcError(err, { method: 'NoSuchMethod', transfer: true, transferStarted: true });
    assert.equal(e.constructor, kv.Unimplemented);
    assert.equal(e.reason, 'TRANSPORT_UNIMPLEMENTED');
  } finally {
    raw.close();
  }
});
