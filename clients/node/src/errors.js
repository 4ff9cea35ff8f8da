'use strict';
// The error contract of kvsvc, mirrored from kvsvc/errors/: one class per
// way a caller reacts, each declaring only its gRPC code and reason. A
// RemoteError envelope (the `error` arm of every response's `outcome`) and a
// transport failure both become one of these classes. test/errors.test.js checks
// these classes against kvsvc.errors' reason catalogue (proto/kvsvc/v1/reasons.json).

const { status: Status } = require('@grpc/grpc-js');

const ENVELOPE_VERSION = 1;

// gRPC's canonical codes by number (the numbers of kvsvc.v1.Code, less "CODE_").
const CODE_NAMES = Object.fromEntries(
  Object.entries(Status).filter(([, v]) => typeof v === 'number').map(([k, v]) => [v, k]),
);

const TRANSFER_STATES = ['UNSPECIFIED', 'NOT_STARTED', 'FINISHED', 'UNKNOWN'];

/** Base of every kvsvc error. Every field is readable, whatever the server sent. */
class KVServiceError extends Error {
  /**
   * @param {string} message
   * @param {object} [fields]
   */
  constructor(message, fields = {}) {
    super(message, fields.cause === undefined ? undefined : { cause: fields.cause });
    const cls = /** @type {typeof KVServiceError} */ (new.target);
    this.name = cls.name;
    /** gRPC status code name, e.g. "INVALID_ARGUMENT"; "UNKNOWN" for a number not known here. */
    this.code = fields.code ?? cls.code;
    /** The numeric code as received (may be one this client does not know). */
    this.codeNumber = fields.codeNumber ?? Status[this.code] ?? Status.UNKNOWN;
    /** Stable machine-readable identifier, e.g. "MAPPING_NOT_FOUND". */
    this.reason = fields.reason ?? cls.reason;
    /** Every dynamic value the message mentions, string to string. */
    this.metadata = { ...(fields.metadata ?? {}) };
    /** Finds the server-side traceback in the server log; for transfers, the transfer id. */
    this.requestId = fields.requestId ?? '';
    /** Whether repeating the same request against this instance may succeed. */
    this.retryable = fields.retryable ?? cls.retryable;
    /** "UNSPECIFIED" (no transfer), "NOT_STARTED", "FINISHED" or "UNKNOWN" (fence first). */
    this.transferState = fields.transferState ?? cls.transferState;
    /** Class name of the exception raised on the server, or of this class for client-made errors. */
    this.type = fields.type || cls.name;
    /** True when the server cut the message to fit its 4096-byte bound. */
    this.messageTruncated = Boolean(fields.messageTruncated);
    /** True for an in-band RemoteError, false for a transport failure or a client-side check. */
    this.remote = Boolean(fields.remote);
    /** The RPC that failed, e.g. "Store". */
    this.method = fields.method ?? '';
    /** Envelope version the server sent (0 for errors not from an envelope). */
    this.envelopeVersion = fields.envelopeVersion ?? 0;
  }

  /** True when the client's buffers may be reused (no copy can still be running). */
  get buffersReusable() {
    return this.transferState !== 'UNKNOWN';
  }

  toString() {
    const rid = this.requestId ? ` request_id=${this.requestId}` : '';
    return `${this.name}: ${this.message} [${this.reason}${rid}]`;
  }

  toJSON() {
    return {
      name: this.name,
      message: this.message,
      code: this.code,
      codeNumber: this.codeNumber,
      reason: this.reason,
      metadata: this.metadata,
      requestId: this.requestId,
      retryable: this.retryable,
      transferState: this.transferState,
      type: this.type,
      messageTruncated: this.messageTruncated,
      remote: this.remote,
      method: this.method,
    };
  }
}
KVServiceError.code = 'UNKNOWN';
KVServiceError.reason = 'UNKNOWN';
KVServiceError.retryable = false;
KVServiceError.transferState = 'UNSPECIFIED';

function define(name, parent, code, reason, extra = {}) {
  const cls = { [name]: class extends parent {} }[name];
  cls.code = code;
  cls.reason = reason;
  Object.assign(cls, extra);
  return cls;
}

// --- request errors: the caller fixes its input or falls back (recompute) ---
const InvalidRequest = define('InvalidRequest', KVServiceError, 'INVALID_ARGUMENT', 'INVALID_ARGUMENT');
/** A request this server does not understand (unset oneof, unknown enum, newer envelope). */
const UnsupportedRequest = define('UnsupportedRequest', InvalidRequest, 'INVALID_ARGUMENT', 'UNSUPPORTED_REQUEST');
/** Request bytes that the server could not parse as the method's message. */
const MalformedRequest = define('MalformedRequest', InvalidRequest, 'INVALID_ARGUMENT', 'MALFORMED_REQUEST');
const LayoutMismatch = define('LayoutMismatch', KVServiceError, 'FAILED_PRECONDITION', 'LAYOUT_MISMATCH');
const NotFound = define('NotFound', KVServiceError, 'NOT_FOUND', 'NOT_FOUND');
/** A chunk the caller required is not in the store. */
const Miss = define('Miss', NotFound, 'NOT_FOUND', 'CHUNK_NOT_FOUND');
/** The mapping is unknown here: the server restarted or it was unmapped. Map again. */
const MappingLost = define('MappingLost', NotFound, 'NOT_FOUND', 'MAPPING_NOT_FOUND');
/** A CUDA IPC handle reached a server that has no CUDA: no retry can help here. */
const CudaUnavailable = define('CudaUnavailable', KVServiceError, 'FAILED_PRECONDITION', 'CUDA_UNAVAILABLE');
const CapacityExhausted = define('CapacityExhausted', KVServiceError, 'RESOURCE_EXHAUSTED', 'CAPACITY_EXHAUSTED');
/** The caller's tenant may not do this; the message never says what exists. */
const PermissionDenied = define('PermissionDenied', KVServiceError, 'PERMISSION_DENIED', 'PERMISSION_DENIED');
/** No valid credentials (a missing, unknown or expired token). */
const Unauthenticated = define('Unauthenticated', KVServiceError, 'UNAUTHENTICATED', 'UNAUTHENTICATED');
const Unimplemented = define('Unimplemented', KVServiceError, 'UNIMPLEMENTED', 'UNIMPLEMENTED');
// --- deadlines and transport ---
const DeadlineExceeded = define('DeadlineExceeded', KVServiceError, 'DEADLINE_EXCEEDED', 'DEADLINE_EXCEEDED');
const Cancelled = define('Cancelled', KVServiceError, 'CANCELLED', 'CANCELLED');
/** The transport failed (connection refused or lost); another try may succeed. */
const ServiceUnavailable = define('ServiceUnavailable', KVServiceError, 'UNAVAILABLE', 'TRANSPORT_UNAVAILABLE', { retryable: true });
/** This instance had a fatal failure or is shutting down; go elsewhere. */
const ServiceNotServing = define('ServiceNotServing', KVServiceError, 'UNAVAILABLE', 'SERVICE_NOT_SERVING');
// --- transfers whose outcome matters for buffer reuse ---
/** A copy may still be writing the client's blocks: keep them leased, fence first. */
const TransferUnprovable = define('TransferUnprovable', KVServiceError, 'UNKNOWN', 'TRANSFER_UNPROVABLE', { transferState: 'UNKNOWN' });
/** A mapped region cannot be used (missing, too small, or truncated by its owner). */
const RegionUnavailable = define('RegionUnavailable', KVServiceError, 'FAILED_PRECONDITION', 'REGION_UNAVAILABLE');
// --- server faults ---
/** A server handler failed unexpectedly; the traceback is in the server log. */
const RemoteHandlerError = define('RemoteHandlerError', KVServiceError, 'INTERNAL', 'HANDLER_FAILED');
/** A stored chunk failed its checksum: memory corruption on the server. */
const DataLoss = define('DataLoss', RemoteHandlerError, 'DATA_LOSS', 'CHECKSUM_MISMATCH');
/** Device error, dead or stalled transfer worker: the instance stops serving. */
const FatalServerError = define('FatalServerError', RemoteHandlerError, 'INTERNAL', 'FATAL_SERVER_ERROR');

// kvsvc.errors' declaration order: the first class declared for a code is its default.
const CLASSES = [
  InvalidRequest, UnsupportedRequest, MalformedRequest, LayoutMismatch, NotFound, Miss, MappingLost,
  CudaUnavailable, CapacityExhausted, PermissionDenied, Unauthenticated, Unimplemented, DeadlineExceeded, Cancelled, ServiceUnavailable,
  ServiceNotServing, TransferUnprovable, RegionUnavailable, RemoteHandlerError, DataLoss,
  FatalServerError,
];
const BY_REASON = new Map(CLASSES.map((c) => [c.reason, c]));
const BY_CODE = new Map();
for (const c of CLASSES) if (!BY_CODE.has(c.code)) BY_CODE.set(c.code, c);
BY_CODE.set('UNAVAILABLE', ServiceUnavailable);
BY_CODE.set('INTERNAL', RemoteHandlerError);
BY_CODE.set('UNKNOWN', RemoteHandlerError);

function codeName(value) {
  // proto-loader gives the enum name ("CODE_NOT_FOUND"), or the number when unknown.
  // CODE_UNSPECIFIED (0) stays "UNSPECIFIED" and maps to no class but the base one.
  const num = codeNumber(value);
  if (num === 0) return 'UNSPECIFIED';
  return CODE_NAMES[num] ?? 'UNKNOWN';
}

function codeNumber(value) {
  if (typeof value === 'number') return value;
  const name = String(value ?? '').replace(/^CODE_/, '');
  if (name === 'UNSPECIFIED' || name === '') return 0;
  return name in Status ? Status[name] : Status.UNKNOWN;
}

function transferStateName(value) {
  if (typeof value === 'number') return TRANSFER_STATES[value] ?? `UNRECOGNIZED_${value}`;
  if (!value) return 'UNSPECIFIED';
  return String(value).replace(/^TRANSFER_STATE_/, '');
}

const BY_NAME = new Map(CLASSES.map((c) => [c.name, c]));

/**
 * The error a client raises for a RemoteError envelope (kvsvc.errors' from_remote_error):
 * transfer_state UNKNOWN gives TransferUnprovable, else the class named by the envelope's
 * `type`, else the class of its reason, else of its code, else KVServiceError.
 * @param {object} err the envelope as decoded by proto-loader (or a plain object like it)
 * @param {{method?: string}} [context]
 */
function fromRemoteError(err, context = {}) {
  const code = codeName(err.code);
  const transferState = transferStateName(err.transferState);
  let cls;
  if (transferState === 'UNKNOWN') cls = TransferUnprovable;
  // The server raises these same classes: its class name is the best key,
  // then the stable reason, then the code (a newer server's new reason).
  else cls = BY_NAME.get(err.type) || BY_REASON.get(err.reason) || BY_CODE.get(code) || KVServiceError;
  return new cls(err.message ?? '', {
    code,
    codeNumber: codeNumber(err.code ?? 0),
    reason: err.reason ?? '',
    metadata: err.metadata ?? {},
    transferState,
    retryable: Boolean(err.retryable),
    requestId: err.requestId ?? '',
    type: err.type ?? '',
    messageTruncated: err.messageTruncated,
    remote: true,
    method: context.method,
    envelopeVersion: err.envelopeVersion ?? 0,
  });
}

/**
 * Map a transport failure (kvsvc.errors' from_grpc_error); a transfer whose reply
 * was lost after it may have reached the server becomes TransferUnprovable.
 * @param {{code?: number, details?: string, message?: string}} err a grpc-js ServiceError
 * @param {{requestId?: string, method?: string, transferStarted?: boolean, transfer?: boolean}} [context]
 */
function fromGrpcError(err, context = {}) {
  const num = typeof err.code === 'number' ? err.code : Status.UNKNOWN;
  const code = CODE_NAMES[num] ?? 'UNKNOWN';
  const details = err.details || code;
  const metadata = { grpcCode: code };
  const base = {
    metadata,
    requestId: context.requestId ?? '',
    code,
    codeNumber: num,
    method: context.method,
    cause: err,
  };
  // UNIMPLEMENTED and UNAUTHENTICATED are answered before any handler runs.
  if (context.transferStarted && code !== 'UNIMPLEMENTED' && code !== 'UNAUTHENTICATED') {
    return new TransferUnprovable(`transfer outcome unknown after ${code}: ${details}`, base);
  }
  let cls = BY_CODE.get(code) || KVServiceError;
  if (cls === RemoteHandlerError) cls = KVServiceError;
  return new cls(details, {
    ...base,
    reason: `TRANSPORT_${code}`,
    retryable: code === 'UNAVAILABLE',
    // A transfer that provably never reached the server touched no buffer.
    transferState: context.transfer ? 'NOT_STARTED' : 'UNSPECIFIED',
  });
}

module.exports = {
  ENVELOPE_VERSION,
  KVServiceError,
  InvalidRequest,
  UnsupportedRequest,
  MalformedRequest,
  LayoutMismatch,
  NotFound,
  Miss,
  MappingLost,
  CudaUnavailable,
  CapacityExhausted,
  PermissionDenied,
  Unauthenticated,
  Unimplemented,
  DeadlineExceeded,
  Cancelled,
  ServiceUnavailable,
  ServiceNotServing,
  TransferUnprovable,
  RegionUnavailable,
  RemoteHandlerError,
  DataLoss,
  FatalServerError,
  CLASSES,
  fromRemoteError,
  fromGrpcError,
};
