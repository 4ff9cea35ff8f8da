'use strict';
// The client's end of a Session stream (kvsvc/session.py is the Python one):
// Lookup, Store, Retrieve and Fence requests multiplexed on one bidirectional
// stream, each with its own id and deadline, answered in any order with the same
// response messages (and RemoteError envelopes) as the unary calls.
//
// Every request ends: with its answer, at its deadline or when its signal aborts
// (answered here, as grpc-js answers a unary call), or at once when the stream
// breaks. A request written to the stream may have started on the server, so a
// transfer's break, deadline or abort is TransferUnprovable exactly as on a unary
// call; one never written (the stream had not opened yet) provably did not start.
// Nothing is written before the server's initial metadata (a kvsvc server sends
// it first). A server without the RPC answers UNIMPLEMENTED: nothing ran there
// (grpc may send empty headers first, so a request can have been written), and
// the client sends the same requests again as unary calls.

const grpc = require('@grpc/grpc-js');

const { status: Status } = grpc;
const PATH = '/kvsvc.v1.KVCacheService/Session';
/** The unary RPCs a session carries -> their SessionRequest/SessionResponse field. */
const FIELDS = { Lookup: 'lookup', Store: 'store', Retrieve: 'retrieve', Fence: 'fence' };
const CODE_NAMES = Object.fromEntries(Object.entries(Status).map(([k, v]) => [v, k]));

/** A status as grpc-js reports a failed call ({code, details}), for fromGrpcError. */
function statusError(code, details) {
  return { code, details, message: `${code} ${CODE_NAMES[code]}: ${details}` };
}

/** What pending requests get when the stream ends under them. */
function broke(err) {
  if (err.code === Status.UNIMPLEMENTED) return statusError(Status.UNIMPLEMENTED, 'the server has no Session RPC');
  if (err.code === Status.UNAUTHENTICATED) return err; // refused before any request ran, as unary
  const name = CODE_NAMES[err.code] ?? 'UNKNOWN';
  return statusError(Status.UNAVAILABLE, `the session stream broke (${name}: ${err.details ?? err.message})`);
}

class Session {
  /**
   * @param {grpc.Client} stub the KVCacheService client (its channel carries the stream)
   * @param {grpc.Metadata} metadata the call's metadata (the bearer token)
   * @param {{serialize: Function, deserialize: Function, maxSendBytes: number, idleMs: number}} opts
   */
  constructor(stub, metadata, opts) {
    this.failure = null;
    this.sent = 0; // requests written (tests read it)
    this._serialize = opts.serialize;
    this._maxSendBytes = opts.maxSendBytes;
    this._idleMs = opts.idleMs;
    this._idle = null;
    this._nextId = 1;
    this._pending = new Map(); // id -> {bytes, written, settle}
    this._queue = []; // ids to write once open
    this._open = false;
    // Requests are serialized here (to check their size first), so the stream's
    // serializer passes the bytes through.
    this._call = stub.makeBidiStreamRequest(PATH, (b) => b, opts.deserialize, metadata, {});
    this._call.on('metadata', () => {
      if (this.failure) return;
      this._open = true;
      const queue = this._queue;
      this._queue = [];
      for (const id of queue) this._write(id);
    });
    this._call.on('data', (resp) => {
      const id = Number(resp.id);
      const p = this._pending.get(id);
      if (!p) return; // answered after its caller stopped waiting
      this._pending.delete(id);
      p.settle({ response: resp });
      this._idleCheck();
    });
    this._call.on('error', (err) => this._fail(broke(err)));
    this._call.on('status', (st) => {
      if (st.code === Status.OK) this._fail(statusError(Status.UNAVAILABLE, 'the session stream ended'));
      else this._fail(broke(st));
    });
    // A backstop: every status emits 'status', but nothing must wait on it.
    this._call.on('end', () => this._fail(statusError(Status.UNAVAILABLE, 'the session stream ended')));
  }

  /**
   * Send one request; resolves, never rejects, by `deadlineMs` at the latest:
   * `{response}` (the SessionResponse) or `{error, written}` (a grpc-js-like status,
   * and whether the request may have reached the server).
   * @param {string} method one of FIELDS
   * @param {object} request the unary request (proto-loader form)
   * @param {number} deadlineMs
   * @param {AbortSignal} [signal]
   */
  request(method, request, deadlineMs, signal) {
    if (this.failure) return Promise.resolve({ error: this.failure, written: false });
    const id = this._nextId++;
    const left = Math.max(0, Math.round(deadlineMs - Date.now())); // whole ms
    const msg = { id, timeout: { seconds: Math.floor(left / 1000), nanos: (left % 1000) * 1e6 }, [FIELDS[method]]: request };
    const bytes = this._serialize(msg);
    if (bytes.length > this._maxSendBytes) {
      // Refused here, as grpc-js refuses it for a unary call: sent, it would end the stream.
      return Promise.resolve({
        error: statusError(Status.RESOURCE_EXHAUSTED,
          `Sent message larger than max (${bytes.length} vs. ${this._maxSendBytes})`),
        written: false,
      });
    }
    clearTimeout(this._idle);
    this._idle = null;
    return new Promise((resolve) => {
      let timer = null;
      let onAbort = null;
      const p = { bytes, written: false };
      p.settle = (outcome) => {
        clearTimeout(timer);
        if (onAbort) signal.removeEventListener('abort', onAbort);
        resolve({ ...outcome, written: p.written });
      };
      const giveUp = (error) => {
        if (this._pending.get(id) !== p) return;
        this._pending.delete(id);
        p.settle({ error });
        this._idleCheck();
      };
      timer = setTimeout(() => giveUp(statusError(Status.DEADLINE_EXCEEDED,
        `no answer within ${left / 1000} s (session)`)), left);
      if (signal) {
        onAbort = () => giveUp(statusError(Status.CANCELLED, 'Cancelled on client'));
        signal.addEventListener('abort', onAbort, { once: true });
      }
      this._pending.set(id, p);
      if (this._open) this._write(id);
      else this._queue.push(id);
    });
  }

  _write(id) {
    const p = this._pending.get(id);
    if (!p) return; // its caller stopped waiting before the stream opened
    p.written = true;
    this.sent += 1;
    const { bytes } = p;
    p.bytes = null;
    this._call.write(bytes);
  }

  /** Idle (nothing pending) for idleMs: half-close, so an open stream does not
   * keep the process alive; the next request opens a new one. */
  _idleCheck() {
    if (this._pending.size || this.failure || this._idle) return;
    this._idle = setTimeout(() => {
      this._idle = null;
      if (this._pending.size || this.failure) return;
      this._fail(statusError(Status.UNAVAILABLE, 'the session was idle'));
      this._call.end(); // the server answers what it holds (nothing) and ends it
    }, this._idleMs);
    this._idle.unref();
  }

  /** Ends every pending request with `error` (once; later calls change nothing). */
  _fail(error) {
    if (this.failure) return;
    this.failure = error;
    clearTimeout(this._idle);
    const pending = [...this._pending.values()];
    this._pending.clear();
    this._queue = [];
    for (const p of pending) p.settle({ error });
  }

  /** Pending requests end as CANCELLED (as closing cuts unary calls), then the stream. */
  close() {
    this._fail(statusError(Status.CANCELLED, 'the client was closed'));
    this._call.cancel();
  }
}

module.exports = { Session, FIELDS };
