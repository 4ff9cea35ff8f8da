'use strict';
// The envelope/transport -> class mapping, mirrored from kvsvc/errors/.
const test = require('node:test');
const assert = require('node:assert/strict');
const kv = require('../src');

const envelope = (over) => ({
  envelopeVersion: 1,
  type: 'X',
  message: 'boom',
  messageTruncated: false,
  code: 'CODE_UNKNOWN',
  reason: '',
  metadata: {},
  requestId: 'rid-1',
  retryable: false,
  transferState: 'TRANSFER_STATE_UNSPECIFIED',
  ...over,
});

test('every class is chosen by its reason, and keeps its place in the hierarchy', () => {
  const expected = {
    INVALID_ARGUMENT: [kv.InvalidRequest],
    UNSUPPORTED_REQUEST: [kv.UnsupportedRequest, kv.InvalidRequest],
    MALFORMED_REQUEST: [kv.MalformedRequest, kv.InvalidRequest],
    LAYOUT_MISMATCH: [kv.LayoutMismatch],
    NOT_FOUND: [kv.NotFound],
    CHUNK_NOT_FOUND: [kv.Miss, kv.NotFound],
    MAPPING_NOT_FOUND: [kv.MappingLost, kv.NotFound],
    CUDA_UNAVAILABLE: [kv.CudaUnavailable],
    CAPACITY_EXHAUSTED: [kv.CapacityExhausted],
    PERMISSION_DENIED: [kv.PermissionDenied],
    UNAUTHENTICATED: [kv.Unauthenticated],
    UNIMPLEMENTED: [kv.Unimplemented],
    DEADLINE_EXCEEDED: [kv.DeadlineExceeded],
    CANCELLED: [kv.Cancelled],
    TRANSPORT_UNAVAILABLE: [kv.ServiceUnavailable],
    SERVICE_NOT_SERVING: [kv.ServiceNotServing],
    TRANSFER_UNPROVABLE: [kv.TransferUnprovable],
    REGION_UNAVAILABLE: [kv.RegionUnavailable],
    HANDLER_FAILED: [kv.RemoteHandlerError],
    CHECKSUM_MISMATCH: [kv.DataLoss, kv.RemoteHandlerError],
    FATAL_SERVER_ERROR: [kv.FatalServerError, kv.RemoteHandlerError],
  };
  assert.equal(Object.keys(expected).length, kv.CLASSES.length);
  for (const [reason, classes] of Object.entries(expected)) {
    // The code on the wire disagrees on purpose: the reason wins.
    const e = kv.fromRemoteError(envelope({ reason, code: 'CODE_ABORTED' }));
    assert.equal(e.constructor, classes[0], reason);
    for (const cls of classes) assert.ok(e instanceof cls, `${reason} is a ${cls.name}`);
    assert.ok(e instanceof kv.KVServiceError);
    assert.ok(e instanceof Error);
    assert.equal(e.name, classes[0].name);
    assert.equal(e.code, 'ABORTED');
    assert.equal(e.reason, reason);
  }
});

test('an unknown reason falls back to the class of the code', () => {
  const cases = {
    CODE_INVALID_ARGUMENT: kv.InvalidRequest,
    CODE_FAILED_PRECONDITION: kv.LayoutMismatch,
    CODE_NOT_FOUND: kv.NotFound,
    CODE_RESOURCE_EXHAUSTED: kv.CapacityExhausted,
    CODE_UNIMPLEMENTED: kv.Unimplemented,
    CODE_DEADLINE_EXCEEDED: kv.DeadlineExceeded,
    CODE_CANCELLED: kv.Cancelled,
    CODE_UNAVAILABLE: kv.ServiceUnavailable,
    CODE_INTERNAL: kv.RemoteHandlerError,
    CODE_UNKNOWN: kv.RemoteHandlerError,
    CODE_DATA_LOSS: kv.DataLoss,
    CODE_PERMISSION_DENIED: kv.PermissionDenied,
    CODE_UNAUTHENTICATED: kv.Unauthenticated,
    CODE_UNSPECIFIED: kv.KVServiceError,
  };
  for (const [code, cls] of Object.entries(cases)) {
    const e = kv.fromRemoteError(envelope({ reason: 'SOMETHING_NEW', code }));
    assert.equal(e.constructor, cls, code);
    assert.equal(e.reason, 'SOMETHING_NEW');
  }
});

test('the server class named by `type` wins over reason and code, as kvsvc.errors', () => {
  // Subclasses raised with reasons of their own keep their class.
  const cases = [
    ['UnsupportedRequest', 'UNSUPPORTED_ENVELOPE_VERSION', 'CODE_INVALID_ARGUMENT', kv.UnsupportedRequest],
    ['RegionUnavailable', 'REGION_TRUNCATED', 'CODE_FAILED_PRECONDITION', kv.RegionUnavailable],
    ['FatalServerError', 'TRANSFER_WORKER_FAILED', 'CODE_INTERNAL', kv.FatalServerError],
    ['DeadlineExceeded', 'REGION_NOT_READY', 'CODE_DEADLINE_EXCEEDED', kv.DeadlineExceeded],
    // A type name this client does not know: the reason, then the code, decide.
    ['FailpointError', 'MAPPING_NOT_FOUND', 'CODE_INTERNAL', kv.MappingLost],
    ['FailpointError', 'HANDLER_FAILED', 'CODE_INTERNAL', kv.RemoteHandlerError],
    ['KVServiceError', 'NEW_REASON', 'CODE_RESOURCE_EXHAUSTED', kv.CapacityExhausted],
  ];
  for (const [type, reason, code, cls] of cases) {
    const e = kv.fromRemoteError(envelope({ type, reason, code }));
    assert.equal(e.constructor, cls, `${type}/${reason}`);
    assert.equal(e.type, type);
    assert.equal(e.reason, reason);
  }
});

test('transfer state UNKNOWN always gives TransferUnprovable, keeping the code and reason', () => {
  const e = kv.fromRemoteError(envelope({
    reason: 'FENCE_TIMEOUT', code: 'CODE_DEADLINE_EXCEEDED', type: 'DeadlineExceeded',
    transferState: 'TRANSFER_STATE_UNKNOWN',
  }));
  assert.ok(e instanceof kv.TransferUnprovable);
  assert.equal(e.code, 'DEADLINE_EXCEEDED');
  assert.equal(e.reason, 'FENCE_TIMEOUT');
  assert.equal(e.transferState, 'UNKNOWN');
  assert.equal(e.buffersReusable, false);
});

test('unknown codes, reasons and states still give a KVServiceError with every field readable', () => {
  const e = kv.fromRemoteError(envelope({
    type: 'BrandNewError', message: 'new', messageTruncated: true, code: 99,
    reason: 'BRAND_NEW', metadata: { a: '1' }, requestId: 'r-9', retryable: true,
    transferState: 7, envelopeVersion: 2,
  }), { method: 'Lookup' });
  assert.ok(e instanceof kv.KVServiceError);
  assert.equal(e.constructor, kv.RemoteHandlerError); // unknown code -> UNKNOWN, as kvsvc.errors
  assert.equal(e.code, 'UNKNOWN');
  assert.equal(e.codeNumber, 99);
  assert.equal(e.reason, 'BRAND_NEW');
  assert.equal(e.message, 'new');
  assert.equal(e.messageTruncated, true);
  assert.deepEqual(e.metadata, { a: '1' });
  assert.equal(e.requestId, 'r-9');
  assert.equal(e.retryable, true);
  assert.equal(e.transferState, 'UNRECOGNIZED_7');
  assert.equal(e.type, 'BrandNewError');
  assert.equal(e.method, 'Lookup');
  assert.equal(e.envelopeVersion, 2);
  assert.equal(e.remote, true);
  assert.equal(String(e), 'RemoteHandlerError: new [BRAND_NEW request_id=r-9]');
  assert.deepEqual(JSON.parse(JSON.stringify(e)).reason, 'BRAND_NEW');
});

test('transport failures map by code with a TRANSPORT_ reason, as from_grpc_error', () => {
  const { status } = require('@grpc/grpc-js');
  const cases = [
    [status.UNAVAILABLE, kv.ServiceUnavailable, true],
    [status.DEADLINE_EXCEEDED, kv.DeadlineExceeded, false],
    [status.CANCELLED, kv.Cancelled, false],
    [status.UNIMPLEMENTED, kv.Unimplemented, false],
    [status.RESOURCE_EXHAUSTED, kv.CapacityExhausted, false],
    [status.INTERNAL, kv.KVServiceError, false], // never RemoteHandlerError: nothing ran
    [status.UNKNOWN, kv.KVServiceError, false],
    [status.DATA_LOSS, kv.DataLoss, false],
    [status.UNAUTHENTICATED, kv.Unauthenticated, false],
    [status.PERMISSION_DENIED, kv.PermissionDenied, false],
  ];
  for (const [code, cls, retryable] of cases) {
    const e = kv.fromGrpcError({ code, details: 'd' }, { requestId: 'r', method: 'Lookup' });
    assert.equal(e.constructor, cls, String(code));
    assert.equal(e.reason, `TRANSPORT_${e.code}`);
    assert.equal(e.codeNumber, code);
    assert.equal(e.retryable, retryable);
    assert.equal(e.remote, false);
    assert.deepEqual(e.metadata, { grpcCode: e.code });
    assert.equal(e.requestId, 'r');
    assert.equal(e.transferState, 'UNSPECIFIED');
  }
  const lost = kv.fromGrpcError({ code: status.UNAVAILABLE, details: 'reset' },
    { requestId: 't1', method: 'Store', transfer: true, transferStarted: true });
  assert.ok(lost instanceof kv.TransferUnprovable);
  assert.equal(lost.code, 'UNAVAILABLE');
  assert.equal(lost.transferState, 'UNKNOWN');
  assert.match(lost.message, /transfer outcome unknown after UNAVAILABLE: reset/);
  const unimpl = kv.fromGrpcError({ code: status.UNIMPLEMENTED, details: 'no' },
    { transfer: true, transferStarted: true });
  assert.equal(unimpl.constructor, kv.Unimplemented);
  assert.equal(unimpl.transferState, 'NOT_STARTED');
  const refused = kv.fromGrpcError({ code: status.UNAUTHENTICATED, details: 'no' },
    { transfer: true, transferStarted: true });
  assert.equal(refused.constructor, kv.Unauthenticated);
  assert.equal(refused.transferState, 'NOT_STARTED');
});

// --- the reason catalogue of kvsvc/errors/ (proto/kvsvc/v1/reasons.json) ---
const fs = require('node:fs');
const path = require('node:path');

const protoDir = process.env.KVSVC_PROTO_DIR || path.resolve(__dirname, '..', '..', '..', 'proto');
const catalogue = JSON.parse(fs.readFileSync(path.join(protoDir, 'kvsvc', 'v1', 'reasons.json'), 'utf8'));
const declared = new Map(catalogue.reasons.map((r) => [r.name, r]));
const mine = new Map([kv.KVServiceError, ...kv.CLASSES].map((c) => [c.name, c]));

test('the classes are those of the catalogue: same parent, code, reason and retryable', () => {
  for (const c of catalogue.classes) {
    const cls = mine.get(c.name);
    if (cls === undefined) {
      assert.ok(!c.everyClient, `${c.name} (${c.reason}) is missing: a server sends it`);
      continue;
    }
    const parent = Object.getPrototypeOf(cls);
    assert.equal(parent === Error ? '' : parent.name, c.parent, `${c.name}'s parent`);
    assert.equal(cls.code, c.code, `${c.name}'s code`);
    assert.equal(cls.reason, c.reason, `${c.name}'s reason`);
    assert.equal(cls.retryable, c.retryable, `${c.name}'s retryable`);
  }
  const known = new Set(catalogue.classes.map((c) => c.name));
  for (const name of mine.keys()) assert.ok(known.has(name), `${name} is not in the catalogue`);
});

test('an unknown reason falls back to the default class of its code, as kvsvc.errors', () => {
  for (const [code, name] of Object.entries(catalogue.defaultClassByCode)) {
    const e = kv.fromRemoteError(envelope({ type: 'NotAClass', reason: 'NOT_DECLARED', code: `CODE_${code}` }));
    assert.equal(e.constructor.name, name, code);
  }
});

test('every server reason comes back as its declared class with its code', () => {
  for (const r of catalogue.reasons) {
    // A bare KVServiceError is never raised by a server (it comes back by its code).
    if (r.by !== 'server' || r.class === 'KVServiceError') continue;
    const sent = { reason: r.name, code: `CODE_${r.code}`, retryable: r.retryable };
    const e = kv.fromRemoteError(envelope({ ...sent, type: r.class }));
    assert.equal(e.constructor.name, r.class, r.name);
    assert.equal(e.code, r.code, r.name);
    assert.equal(e.reason, r.name);
    assert.equal(e.retryable, r.retryable, r.name);
    if (mine.get(r.class).reason === r.name) {
      // A class's own reason finds it even under a type name this client does not know.
      const byReason = kv.fromRemoteError(envelope({ ...sent, type: 'NotAClass', code: 'CODE_ABORTED' }));
      assert.equal(byReason.constructor.name, r.class, `${r.name} by reason`);
    }
  }
});

test('every transport failure gets its declared TRANSPORT_ reason, class and retryable', () => {
  const transport = catalogue.reasons.filter((r) => r.name === `TRANSPORT_${r.code}`);
  assert.equal(transport.length, 16);
  for (const r of transport) {
    const e = kv.fromGrpcError({ code: r.codeNumber, details: 'd' });
    assert.equal(e.constructor.name, r.class, r.name);
    assert.equal(e.code, r.code, r.name);
    assert.equal(e.reason, r.name);
    assert.equal(e.retryable, r.retryable, r.name);
  }
});

test('every reason the client source writes is declared in the catalogue', () => {
  const src = path.resolve(__dirname, '..', 'src');
  const literal = /\breason:\s*'([^']*)'|define\([^)]*?'[A-Z_]+',\s*'([A-Z][A-Z0-9_]*)'/g;
  let found = 0;
  for (const file of fs.readdirSync(src).filter((f) => f.endsWith('.js'))) {
    for (const m of fs.readFileSync(path.join(src, file), 'utf8').matchAll(literal)) {
      const reason = m[1] ?? m[2];
      found += 1;
      assert.ok(declared.has(reason), `${file}: reason ${reason} is not in kvsvc/errors/'s catalogue`);
    }
  }
  assert.ok(found > 15, `found ${found} reason literals`);
});
