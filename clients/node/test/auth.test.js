'use strict';
// Against a real `kvsvc serve` with a tenant file: the token option, tenants kept
// apart, and UNAUTHENTICATED / PERMISSION_DENIED as typed errors.
const test = require('node:test');
const assert = require('node:assert/strict');
const crypto = require('node:crypto');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const kv = require('../src');
const { startServer } = require('./helpers/server');

const TOKEN_A = crypto.randomBytes(16).toString('hex');
const TOKEN_B = crypto.randomBytes(16).toString('hex');
let server;
let dir;

test.before(async () => {
  dir = fs.mkdtempSync(path.join(os.tmpdir(), 'kvsvc-node-auth-'));
  const file = path.join(dir, 'tenants.json');
  fs.writeFileSync(file, JSON.stringify({
    tenants: {
      a: { tokens: [TOKEN_A], namespaces: ['a/*'] },
      b: { tokens: [TOKEN_B], namespaces: ['*'] },
    },
  }));
  server = await startServer({ args: ['--auth-token-file', file] });
});

test.after(async () => {
  await server?.stop();
  fs.rmSync(dir, { recursive: true, force: true });
});

const put = (client, namespace) => client.call('Store', {
  inline: { namespace, chunks: [{ key: Buffer.from('k'), data: Buffer.from('secret') }] },
});

test('a call without a token, or with a wrong one, is Unauthenticated', async () => {
  for (const token of [undefined, crypto.randomBytes(16).toString('hex')]) {
    const client = new kv.KVClient(server.address, { token });
    try {
      await assert.rejects(client.serverInfo(), (e) => {
        assert.equal(e.constructor, kv.Unauthenticated);
        assert.equal(e.code, 'UNAUTHENTICATED');
        return true;
      });
      await assert.rejects(client.healthCheck(), kv.Unauthenticated);
    } finally {
      client.close();
    }
  }
});

test('a token names its tenant: its namespaces, its own chunks', async () => {
  const a = new kv.KVClient(server.address, { token: TOKEN_A });
  const b = new kv.KVClient(server.address, { token: TOKEN_B });
  try {
    assert.equal((await put(a, 'a/x')).storedChunks, 1);
    assert.equal(await a.healthCheck(), 'SERVING');
    await assert.rejects(put(a, 'b/x'), (e) => {
      assert.equal(e.constructor, kv.PermissionDenied);
      assert.equal(e.code, 'PERMISSION_DENIED');
      return true;
    });
    // b may name a/x, but it is b's own: a's chunk is not there.
    const seen = await b.call('Lookup', { namespace: 'a/x', keys: [Buffer.from('k')] });
    assert.equal(seen.hitChunks, 0);
  } finally {
    a.close();
    b.close();
  }
});

test('a token with whitespace is refused before anything is sent', () => {
  assert.throws(() => new kv.KVClient(server.address, { token: 'a b' }), TypeError);
  assert.throws(() => new kv.KVClient(server.address, { tls: { cert: 'x' } }), TypeError);
});
