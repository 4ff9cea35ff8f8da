'use strict';
// A fatal server failure: health flips to NOT_SERVING and transfers are refused.
const test = require('node:test');
const assert = require('node:assert/strict');
const kv = require('../src');
const { startServer } = require('./helpers/server');

test('a fatal transfer failure flips health to NOT_SERVING; later transfers get ServiceNotServing', async (t) => {
  const server = await startServer({ failpoints: 'transfer.before_copy=raise' });
  const client = new kv.KVClient(server.address);
  t.after(async () => {
    client.close();
    await server.stop();
  });

  assert.equal(await client.healthCheck(''), 'SERVING');
  assert.equal(await client.healthCheck(kv.HEALTH_SERVICE_NAME), 'SERVING');

  let requestId = '';
  await assert.rejects(client.store('ns', [{ key: 'k', data: 'v' }]), (e) => {
    requestId = e.requestId;
    assert.equal(e.constructor, kv.FatalServerError);
    assert.ok(e instanceof kv.RemoteHandlerError);
    assert.equal(e.code, 'INTERNAL');
    assert.equal(e.reason, 'TRANSFER_WORKER_FAILED');
    assert.equal(e.metadata.error, 'FailpointError');
    assert.equal(e.transferState, 'FINISHED');
    assert.equal(e.remote, true);
    assert.ok(e.requestId);
    assert.doesNotMatch(e.message, /Traceback/, 'tracebacks stay in the server log');
    return true;
  });
  // The traceback is in the server log, under the request id the error carries
  // (bounded wait: the log arrives through a pipe, maybe after the reply).
  for (let i = 0; i < 200 && !server.log().includes(requestId); i++) {
    await new Promise((r) => setTimeout(r, 50));
  }
  assert.match(server.log(), new RegExp(`${requestId}[^]*Traceback`));

  // Health answers the truth right away (bounded poll, in case it lags the reply).
  const t0 = Date.now();
  let status = await client.healthCheck('');
  while (status !== 'NOT_SERVING' && Date.now() - t0 < 10_000) {
    await new Promise((r) => setTimeout(r, 50));
    status = await client.healthCheck('');
  }
  assert.equal(status, 'NOT_SERVING');
  assert.equal(await client.healthCheck(kv.HEALTH_SERVICE_NAME), 'NOT_SERVING');

  const info = await client.serverInfo();
  assert.equal(info.serving, false);
  assert.equal(info.failureReason, 'TRANSFER_WORKER_FAILED');
  assert.ok(info.failureTime instanceof Date);
  assert.ok(info.failureTime.getTime() >= info.startTime.getTime());

  for (const attempt of [
    () => client.store('ns', [{ key: 'k2', data: 'v' }]),
    () => client.retrieve('ns', ['k']),
  ]) {
    await assert.rejects(attempt(), (e) => {
      assert.equal(e.constructor, kv.ServiceNotServing);
      assert.equal(e.code, 'UNAVAILABLE');
      assert.equal(e.reason, 'SERVICE_NOT_SERVING');
      assert.equal(e.retryable, false, 'go elsewhere: this instance stays down');
      assert.equal(e.metadata.failureReason, 'TRANSFER_WORKER_FAILED');
      assert.equal(e.transferState, 'NOT_STARTED');
      return true;
    });
  }
  // Control calls still answer, so an operator can see what happened.
  assert.equal((await client.lookup('ns', ['k'])).hitChunks, 0);
});
