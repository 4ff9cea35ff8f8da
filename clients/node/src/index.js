'use strict';
// Node.js client for kvsvc.v1.KVCacheService on @grpc/grpc-js. The .proto files
// are loaded at run time by @grpc/proto-loader: from the package's own proto/ once
// installed (npm pack copies the repository's proto/ in), from the repository's
// proto/ in a checkout (override with the protoDir option or KVSVC_PROTO_DIR), so
// there is no generated code to keep in sync.

const fs = require('node:fs');
const path = require('node:path');
const crypto = require('node:crypto');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const errors = require('./errors');
const { Session, FIELDS: SESSION_FIELDS } = require('./session');
const { EventWatch, checkCursor } = require('./events');

const { ENVELOPE_VERSION, fromGrpcError, fromRemoteError, ServiceUnavailable, Cancelled, DeadlineExceeded } = errors;

const DEFAULT_TRANSFER_DEADLINE_S = 30;
const DEFAULT_CONTROL_DEADLINE_S = 5;
const HEALTH_SERVICE_NAME = 'kvsvc.v1.KVCacheService';
const MiB = 1 << 20;
// The same limits as the server (kvsvc/config.py channel_options).
const CHANNEL_OPTIONS = {
  'grpc.max_send_message_length': 256 * MiB,
  'grpc.max_receive_message_length': 256 * MiB,
  'grpc.keepalive_time_ms': 30000,
  'grpc.keepalive_timeout_ms': 10000,
  'grpc.keepalive_permit_without_calls': 0,
  'grpc.http2.max_pings_without_data': 0,
};
const LOADER_OPTIONS = {
  keepCase: false,
  longs: Number,
  enums: String,
  bytes: Buffer,
  defaults: true,
  oneofs: true,
};
// RPCs that move bytes or wait for copies get the transfer deadline by default
// (as the Python client); every other call gets the control one.
const LONG_CALLS = new Set(['Store', 'Retrieve', 'Unmap', 'Fence']);
const METHODS = ['Map', 'Unmap', 'Store', 'Retrieve', 'Lookup', 'Fence', 'GetServerInfo'];
// A session with nothing pending for this long is half-closed: an open stream
// would keep the process alive. The next call opens a new one.
const SESSION_IDLE_MS = 1000;

/**
 * Where the contract is: KVSVC_PROTO_DIR, else the package's own proto/ (an
 * installed package carries it: npm pack copies it in), else the repository's
 * proto/ (a checkout).
 */
function defaultProtoDir() {
  if (process.env.KVSVC_PROTO_DIR) return process.env.KVSVC_PROTO_DIR;
  const packaged = path.resolve(__dirname, '..', 'proto');
  if (fs.existsSync(path.join(packaged, 'kvsvc', 'v1', 'kv_cache_service.proto'))) return packaged;
  return path.resolve(__dirname, '..', '..', '..', 'proto');
}

const loaded = new Map();
function loadServices(protoDir) {
  if (!loaded.has(protoDir)) {
    const kv = protoLoader.loadSync('kvsvc/v1/kv_cache_service.proto', {
      ...LOADER_OPTIONS,
      includeDirs: [protoDir],
    });
    const healthProto = require.resolve('grpc-health-check/proto/health/v1/health.proto');
    const health = protoLoader.loadSync(healthProto, LOADER_OPTIONS);
    loaded.set(protoDir, {
      KVCacheService: grpc.loadPackageDefinition(kv).kvsvc.v1.KVCacheService,
      Health: grpc.loadPackageDefinition(health).grpc.health.v1.Health,
    });
  }
  return loaded.get(protoDir);
}

/**
 * A deadline is a finite number of seconds > 0; anything else throws, naming the setting.
 * @param {unknown} value
 * @param {string} setting
 * @returns {number}
 */
function validateDeadline(value, setting) {
  if (typeof value !== 'number') {
    throw new TypeError(`${setting} must be a number of seconds, got ${describe(value)}`);
  }
  if (!Number.isFinite(value) || value <= 0) {
    throw new RangeError(`${setting} must be finite and > 0 seconds, got ${describe(value)}`);
  }
  return value;
}

function describe(value) {
  if (typeof value === 'string') return JSON.stringify(value);
  if (typeof value === 'bigint') return `${value}n`;
  return String(value);
}

function toBuffer(value, what) {
  if (Buffer.isBuffer(value)) return value;
  if (value instanceof Uint8Array) return Buffer.from(value.buffer, value.byteOffset, value.byteLength);
  if (typeof value === 'string') return Buffer.from(value, 'utf8');
  throw new TypeError(`${what} must be a Buffer, Uint8Array or string, got ${typeof value}`);
}

function toDate(ts) {
  if (!ts) return null;
  return new Date(Number(ts.seconds) * 1000 + Math.floor(Number(ts.nanos) / 1e6));
}

/** PEM bytes: a Buffer, PEM text, or a path to a PEM file. */
function pem(value) {
  if (value == null) return null;
  if (Buffer.isBuffer(value)) return value;
  if (typeof value === 'string') return value.includes('-----BEGIN') ? Buffer.from(value) : fs.readFileSync(value);
  throw new TypeError('a TLS certificate or key is a Buffer, PEM text or a file path');
}

function tlsCredentials(tls) {
  if (tls == null) return grpc.credentials.createInsecure();
  if ((tls.cert == null) !== (tls.key == null)) throw new TypeError('tls.cert and tls.key go together');
  return grpc.credentials.createSsl(pem(tls.ca), pem(tls.key), pem(tls.cert));
}

/** A fresh Metadata per call (grpc-js may add to it), carrying the bearer token if any. */
function bearerMetadata(token) {
  if (token === undefined || token === null) return () => new grpc.Metadata();
  if (typeof token !== 'string' || !token || /[\s]/.test(token)) {
    throw new TypeError('token must be a non-empty string without whitespace');
  }
  return () => {
    const md = new grpc.Metadata();
    md.set('authorization', `Bearer ${token}`);
    return md;
  };
}

class KVClient {
  /**
   * @param {string} address host:port of a kvsvc server (e.g. "127.0.0.1:50051")
   * @param {object} [options]
   * @param {number} [options.transferDeadline=30] default seconds for Store/Retrieve/Unmap/Fence
   * @param {number} [options.controlDeadline=5] default seconds for every other call
   * @param {grpc.ChannelCredentials} [options.credentials] default: insecure (or `tls`)
   * @param {string} [options.token] bearer token of a server with --auth-token-file,
   *   sent as `authorization: Bearer <token>` metadata on every call (never logged)
   * @param {{ca?: Buffer|string, cert?: Buffer|string, key?: Buffer|string, serverName?: string}} [options.tls]
   *   TLS: the CA of the server's certificate (PEM, or a path to one; default: the
   *   system roots), the client's own certificate and key for mTLS, and the name to
   *   verify when it differs from the address's host
   * @param {object} [options.channelOptions] extra grpc-js channel options
   * @param {string} [options.protoDir] directory holding kvsvc/v1/*.proto
   * @param {boolean} [options.session=true] send Lookup/Store/Retrieve/Fence on one
   *   Session stream (opened at the first call, again after a break; unary calls
   *   to a server without the Session RPC); false: unary calls only
   */
  constructor(address, options = {}) {
    if (typeof address !== 'string' || !address) {
      throw new TypeError('address must be a non-empty "host:port" string');
    }
    this.address = address;
    // Only `undefined` means "the default"; null, NaN, 0... are errors.
    this.transferDeadline = validateDeadline(options.transferDeadline === undefined
      ? DEFAULT_TRANSFER_DEADLINE_S : options.transferDeadline, 'transferDeadline');
    this.controlDeadline = validateDeadline(options.controlDeadline === undefined
      ? DEFAULT_CONTROL_DEADLINE_S : options.controlDeadline, 'controlDeadline');
    const services = loadServices(options.protoDir ?? defaultProtoDir());
    const creds = options.credentials ?? tlsCredentials(options.tls);
    const channelOptions = { ...CHANNEL_OPTIONS, ...(options.channelOptions ?? {}) };
    if (options.tls?.serverName) channelOptions['grpc.ssl_target_name_override'] = options.tls.serverName;
    if (options.session !== undefined && typeof options.session !== 'boolean') {
      throw new TypeError(`session must be true or false, got ${describe(options.session)}`);
    }
    /** False once unary only: `session: false`, or the server has no Session RPC. */
    this.useSession = options.session !== false;
    this._session = null;
    this._closed = false;
    this._watches = new Set();
    const { Session: method } = services.KVCacheService.service;
    this._sessionOptions = {
      serialize: method.requestSerialize,
      deserialize: method.responseDeserialize,
      maxSendBytes: channelOptions['grpc.max_send_message_length'],
      idleMs: SESSION_IDLE_MS,
    };
    this._metadata = bearerMetadata(options.token);
    this._stub = new services.KVCacheService(address, creds, channelOptions);
    // Health shares the channel (and so the connection) of the service stub.
    this._health = new services.Health(address, creds, {
      ...channelOptions,
      channelOverride: this._stub.getChannel(),
    });
  }

  /**
   * Close the session, the event watches and the channel; calls in flight fail with
   * Cancelled/ServiceUnavailable, watches' iterations end with Cancelled.
   */
  close() {
    this._closed = true;
    this._session?.close();
    for (const call of this._watches) call.cancel();
    this._stub.close();
  }

  /** The open session (opened again after a break or an idle close), or null: unary. */
  _sessionFor(method) {
    if (!this.useSession || this._closed || !SESSION_FIELDS[method]) return null;
    if (!this._session || this._session.failure) {
      this._session = new Session(this._stub, this._metadata(), this._sessionOptions);
    }
    return this._session;
  }

  _deadlineSeconds(opts, long) {
    if (opts.deadline === undefined) return long ? this.transferDeadline : this.controlDeadline;
    return validateDeadline(opts.deadline, 'deadline');
  }

  /**
   * Invoke any KVCacheService RPC with a request object in proto-loader form
   * (camelCase fields, Buffers for bytes). The header's request id is filled in
   * when empty; a RemoteError or transport failure rejects with a KVServiceError.
   * A Store/Retrieve of mapped blocks whose reply is lost after it may have
   * reached the server rejects with TransferUnprovable: fence its request id
   * before reusing the blocks.
   * @param {string} method e.g. "Map", "Store", "Fence"
   * @param {object} request
   * @param {{deadline?: number, signal?: AbortSignal}} [opts]
   * @returns {Promise<object>} the `result` arm of the response
   */
  async call(method, request = {}, opts = {}) {
    if (!METHODS.includes(method)) {
      throw new TypeError(`unknown method ${describe(method)}; one of ${METHODS.join(', ')}`);
    }
    // Only a copy between mapped memory and the store can touch the caller's buffers.
    const transfer = (method === 'Store' || method === 'Retrieve') && request.blocks != null;
    const seconds = this._deadlineSeconds(opts, LONG_CALLS.has(method));
    const header = { envelopeVersion: ENVELOPE_VERSION, ...(request.header ?? {}) };
    // 128 random bits: a transfer id a Fence names must not be guessable.
    if (!header.requestId) header.requestId = crypto.randomBytes(16).toString('hex');
    const req = { ...request, header };
    const deadlineMs = Date.now() + seconds * 1000;
    const context = { method, requestId: header.requestId, transfer };
    const notSent = () => new Cancelled(`${method} cancelled before it was sent`, {
      ...context, reason: 'TRANSPORT_CANCELLED', metadata: { grpcCode: 'CANCELLED' },
      transferState: transfer ? 'NOT_STARTED' : 'UNSPECIFIED',
    });
    if (opts.signal?.aborted) throw notSent();
    let response = await this._overSession(method, req, deadlineMs, opts.signal, context);
    if (response === null) response = await this._unary(method, req, deadlineMs, opts.signal, context, notSent);
    if (response.outcome === 'error' && response.error) {
      throw fromRemoteError(response.error, { method });
    }
    if (response.outcome !== 'result' || !response.result) {
      // A newer server may answer with an outcome this client does not know.
      throw new errors.KVServiceError(`${method} response carries no result and no error`, {
        ...context, reason: 'EMPTY_RESPONSE', transferState: transfer ? 'UNKNOWN' : 'UNSPECIFIED',
      });
    }
    return response.result;
  }

  /**
   * The unary response of a call carried by the session, or null: send it unary
   * (no session, or the server has no Session RPC).
   */
  async _overSession(method, req, deadlineMs, signal, context) {
    const session = this._sessionFor(method);
    if (!session) return null;
    const out = await session.request(method, req, deadlineMs, signal);
    if (out.error) {
      if (out.error.code === grpc.status.UNIMPLEMENTED) {
        this.useSession = false; // the server has no Session RPC: unary from now on
        return null;
      }
      throw fromGrpcError(out.error, { ...context, transferStarted: context.transfer && out.written });
    }
    const r = out.response;
    if (r.response === 'error' && r.error) { // a request the server could not take as its kind
      throw fromRemoteError(r.error, { method });
    }
    return r[SESSION_FIELDS[method]] ?? {}; // neither: EMPTY_RESPONSE
  }

  async _unary(method, req, deadlineMs, signal, context, notSent) {
    const { transfer } = context;
    if (transfer) {
      await this._connected(deadlineMs, context);
      if (signal?.aborted) throw notSent();
    }
    return new Promise((resolve, reject) => {
      let onAbort;
      const call = this._stub[method](req, this._metadata(), { deadline: deadlineMs }, (err, resp) => {
        if (onAbort) signal.removeEventListener('abort', onAbort);
        if (err) {
          // A failed pick ("No connection established") proves nothing was sent.
          const sent = transfer && !/^No connection established/.test(err.details ?? '');
          reject(fromGrpcError(err, { ...context, transferStarted: sent }));
        } else {
          resolve(resp);
        }
      });
      if (signal) {
        onAbort = () => call.cancel();
        signal.addEventListener('abort', onAbort, { once: true });
      }
    });
  }

  /**
   * Before a transfer is sent, wait (within its deadline) for a connection, so
   * that a server that cannot be reached fails as "not started", never as
   * "unprovable".
   */
  async _connected(deadlineMs, context) {
    const channel = this._stub.getChannel();
    const S = grpc.connectivityState;
    for (;;) {
      const state = channel.getConnectivityState(true);
      if (state === S.READY) return;
      const notStarted = { ...context, transferState: 'NOT_STARTED', metadata: { grpcCode: 'UNAVAILABLE', channelState: S[state] } };
      if (state === S.TRANSIENT_FAILURE || state === S.SHUTDOWN) {
        throw new ServiceUnavailable(
          `no connection to ${this.address} (channel ${S[state]}): ${context.method} not started`,
          { ...notStarted, retryable: state !== S.SHUTDOWN },
        );
      }
      const changed = await new Promise((resolve) => {
        channel.watchConnectivityState(state, deadlineMs, (err) => resolve(!err));
      });
      if (!changed) {
        throw new DeadlineExceeded(
          `no connection to ${this.address} before the deadline: ${context.method} not started`,
          { ...notStarted, reason: 'TRANSPORT_DEADLINE_EXCEEDED', metadata: { ...notStarted.metadata, grpcCode: 'DEADLINE_EXCEEDED' } },
        );
      }
    }
  }

  /**
   * Store chunks given as bytes under keys in a namespace (transfer deadline).
   * Keys already present are skipped (counted in presentChunks).
   * @param {string} namespace
   * @param {Array<{key: Buffer|Uint8Array|string, data: Buffer|Uint8Array|string}>} chunks
   * @param {{deadline?: number, signal?: AbortSignal, requestId?: string}} [opts]
   */
  async store(namespace, chunks, opts = {}) {
    const req = {
      header: { requestId: opts.requestId ?? '' },
      inline: {
        namespace,
        chunks: chunks.map((c, i) => ({
          key: toBuffer(c.key, `chunks[${i}].key`),
          data: toBuffer(c.data, `chunks[${i}].data`),
        })),
      },
    };
    return this.call('Store', req, opts);
  }

  /**
   * Retrieve the leading present chunks of `keys`; loading stops at the first miss
   * (transfer deadline).
   * @param {string} namespace
   * @param {Array<Buffer|Uint8Array|string>} keys
   * @param {{deadline?: number, signal?: AbortSignal, requestId?: string}} [opts]
   * @returns {Promise<{loadedChunks: number, chunks: Array<{key: Buffer, data: Buffer}>, loadedBytes: number, transferId: string, serverStartId: string}>}
   */
  async retrieve(namespace, keys, opts = {}) {
    const req = {
      header: { requestId: opts.requestId ?? '' },
      inline: { namespace, keys: keys.map((k, i) => toBuffer(k, `keys[${i}]`)) },
    };
    return this.call('Retrieve', req, opts);
  }

  /**
   * Count the leading keys that are present. `scope` is a namespace (any layout),
   * or `{namespace}` / `{mappingId}` (that mapping's layout only).
   * @param {string|{namespace: string}|{mappingId: string}} scope
   * @param {Array<Buffer|Uint8Array|string>} keys
   * @param {{deadline?: number, signal?: AbortSignal}} [opts]
   * @returns {Promise<{hitChunks: number, serverStartId: string}>}
   */
  async lookup(scope, keys, opts = {}) {
    const s = typeof scope === 'string' ? { namespace: scope } : { ...scope };
    const req = { keys: keys.map((k, i) => toBuffer(k, `keys[${i}]`)) };
    if (s.mappingId !== undefined) req.mappingId = s.mappingId;
    else req.namespace = s.namespace;
    return this.call('Lookup', req, opts);
  }

  /**
   * Wait until no copy of a mapping or of the listed transfers is running; ids the
   * server never saw are barred from ever starting.
   * @param {{mappingId?: string, transferIds?: string[]}} what
   * @param {{deadline?: number, signal?: AbortSignal}} [opts]
   */
  async fence(what, opts = {}) {
    return this.call('Fence', { mappingId: what.mappingId ?? '', transferIds: what.transferIds ?? [] }, opts);
  }

  /**
   * Version, restart identity, capacity, usage and health of the server.
   * Timestamps are Dates (failureTime is null when the server never failed).
   */
  async serverInfo(opts = {}) {
    const r = await this.call('GetServerInfo', {}, opts);
    return { ...r, startTime: toDate(r.startTime), failureTime: toDate(r.failureTime) };
  }

  /**
   * Follow what the server holds (WatchEvents): an async iterator of event batches
   * (`for await (const batch of client.watchEvents(...))`), each with the `cursor`
   * to keep; pass it back as `cursor` to resume after a break. No cursor, or one the
   * server can no longer serve, starts with a `lost` batch and a snapshot. The
   * stream has no deadline unless `deadline` is given (seconds, for its whole life);
   * it ends with a typed error, or quietly by `close()` or a `break`. On a closed
   * client it throws Cancelled.
   * @param {{namespaces?: string[], cursor?: {incarnation: string, sequence: number}|null,
   *   snapshotPageKeys?: number, deadline?: number, signal?: AbortSignal, requestId?: string}} [opts]
   * @returns {EventWatch}
   */
  watchEvents(opts = {}) {
    const cursor = checkCursor(opts.cursor);
    const namespaces = opts.namespaces ?? [];
    if (!Array.isArray(namespaces) || namespaces.some((n) => typeof n !== 'string')) {
      throw new TypeError('namespaces must be an array of strings');
    }
    const pageKeys = opts.snapshotPageKeys ?? 0;
    if (!Number.isInteger(pageKeys) || pageKeys < 0 || pageKeys > 0xffffffff) {
      throw new TypeError(`snapshotPageKeys must be an integer >= 0, got ${describe(pageKeys)}`);
    }
    const requestId = opts.requestId || crypto.randomBytes(16).toString('hex');
    const req = {
      header: { envelopeVersion: ENVELOPE_VERSION, requestId },
      namespaces,
      cursor,
      snapshotPageKeys: pageKeys,
    };
    const callOpts = {};
    if (opts.deadline !== undefined) {
      callOpts.deadline = Date.now() + validateDeadline(opts.deadline, 'deadline') * 1000;
    }
    if (this._closed) {
      throw new Cancelled('WatchEvents on a closed client', {
        method: 'WatchEvents', requestId, reason: 'TRANSPORT_CANCELLED', metadata: { grpcCode: 'CANCELLED' },
      });
    }
    const call = this._stub.WatchEvents(req, this._metadata(), callOpts);
    if (opts.signal?.aborted) call.cancel();
    this._watches.add(call);
    return new EventWatch(call, {
      requestId, cursor, signal: opts.signal, onEnd: () => this._watches.delete(call),
    });
  }

  /**
   * grpc.health.v1 Check. `service` is "" (the whole server) or "kvsvc.v1.KVCacheService".
   * @returns {Promise<'SERVING'|'NOT_SERVING'|'UNKNOWN'|'SERVICE_UNKNOWN'>}
   */
  async healthCheck(service = '', opts = {}) {
    const seconds = this._deadlineSeconds(opts, false);
    return new Promise((resolve, reject) => {
      this._health.Check({ service }, this._metadata(), { deadline: Date.now() + seconds * 1000 }, (err, resp) => {
        if (err) reject(fromGrpcError(err, { method: 'Health.Check' }));
        else resolve(resp.status);
      });
    });
  }
}

module.exports = {
  KVClient,
  EventWatch,
  validateDeadline,
  DEFAULT_TRANSFER_DEADLINE_S,
  DEFAULT_CONTROL_DEADLINE_S,
  HEALTH_SERVICE_NAME,
  ...errors,
};
