'use strict';
// The client's end of WatchEvents (kvsvc/server/events is the server's): an async
// iterator over the server's event batches, with the cursor to keep and resume from.
//
// A batch is the EventBatch as proto-loader decodes it (camelCase, Buffers for keys,
// enum names as strings), plus `cursor`: where a caller that applied every batch so
// far stands, or null while it is inside a resync (from a `lost` batch to the
// snapshot batch with `snapshotDone`): a cursor taken there would skip the rest of
// the snapshot. The stream ends with a typed error (a RemoteError batch, e.g.
// ServiceNotServing, or a transport failure, e.g. ServiceUnavailable,
// Unauthenticated), never in silence; only `close()` ends the iteration quietly.

const { fromGrpcError, fromRemoteError, KVServiceError, Cancelled } = require('./errors');

const METHOD = 'WatchEvents';
const UNAVAILABLE = 14;

/**
 * A cursor as the caller gave it, checked: {incarnation: string, sequence: integer >= 0}.
 * @param {unknown} cursor
 * @returns {{incarnation: string, sequence: number} | null}
 */
function checkCursor(cursor) {
  if (cursor == null) return null;
  if (typeof cursor !== 'object' || typeof cursor.incarnation !== 'string'
      || !Number.isSafeInteger(cursor.sequence) || cursor.sequence < 0) {
    throw new TypeError('cursor must be {incarnation: string, sequence: integer >= 0} or null');
  }
  return { incarnation: cursor.incarnation, sequence: cursor.sequence };
}

/**
 * Where a caller stands once it applied `batch`: the batch's point, except inside a
 * resync (a `lost` batch and the snapshot pages before the one with `snapshotDone`).
 */
function cursorAfter(batch) {
  const resumable = batch.snapshotDone || (!batch.lost && !batch.snapshot);
  return resumable ? { incarnation: batch.incarnation, sequence: Number(batch.sequence) } : null;
}

class EventWatch {
  /**
   * Made by KVClient.watchEvents; the call is open already.
   * @param {import('@grpc/grpc-js').ClientReadableStream<any>} call
   * @param {{requestId: string, cursor: object|null, signal?: AbortSignal, onEnd: () => void}} opts
   */
  constructor(call, opts) {
    this._call = call;
    this._requestId = opts.requestId;
    this._cursor = opts.cursor;
    this._closed = false;
    this._done = false;
    this._onEnd = opts.onEnd;
    this._signal = opts.signal;
    this._onAbort = null;
    if (opts.signal) {
      this._onAbort = () => call.cancel();
      opts.signal.addEventListener('abort', this._onAbort, { once: true });
    }
    // Errors are read through the iterator; until then none may go unhandled.
    call.on('error', () => {});
    this._iter = call[Symbol.asyncIterator]();
  }

  /** Where the caller stands after the last batch handed out (null: resync from a snapshot). */
  get cursor() {
    return this._cursor && { ...this._cursor };
  }

  /** The request id the server logs this stream under. */
  get requestId() {
    return this._requestId;
  }

  /** Ends the stream; an iteration in progress ends without an error. */
  close() {
    this._closed = true;
    this._finish();
    this._call.cancel();
  }

  _finish() {
    if (this._done) return;
    this._done = true;
    if (this._onAbort) this._signal.removeEventListener('abort', this._onAbort);
    this._onEnd();
  }

  _typed(err) {
    if (err instanceof KVServiceError) return err;
    if (this._signal?.aborted) {
      return new Cancelled(`${METHOD} cancelled`, {
        method: METHOD, requestId: this._requestId, reason: 'TRANSPORT_CANCELLED',
        metadata: { grpcCode: 'CANCELLED' }, cause: err,
      });
    }
    return fromGrpcError(err, { method: METHOD, requestId: this._requestId });
  }

  /**
   * The next batch: resolves with it, ends (done) after close(), rejects with a typed
   * error when the stream ends any other way.
   * @returns {Promise<IteratorResult<object>>}
   */
  async next() {
    if (this._closed) return { done: true, value: undefined };
    let step;
    try {
      step = await this._iter.next();
    } catch (err) {
      if (this._closed) return { done: true, value: undefined };
      this._finish();
      throw this._typed(err);
    }
    if (this._closed) return { done: true, value: undefined };
    if (step.done) {
      this._finish();
      throw this._typed({ code: UNAVAILABLE, details: 'the events stream ended without an error batch' });
    }
    const resp = step.value;
    if (resp.outcome === 'error' && resp.error) {
      this.close();
      throw fromRemoteError(resp.error, { method: METHOD });
    }
    if (resp.outcome !== 'batch' || !resp.batch) {
      this.close();
      throw new KVServiceError(`${METHOD} response carries no batch and no error`, {
        method: METHOD, requestId: this._requestId, reason: 'EMPTY_RESPONSE',
      });
    }
    const batch = resp.batch;
    batch.sequence = Number(batch.sequence);
    batch.cursor = cursorAfter(batch);
    this._cursor = batch.cursor;
    return { done: false, value: batch };
  }

  /** `break` out of a for-await loop closes the stream. */
  async return() {
    this.close();
    return { done: true, value: undefined };
  }

  [Symbol.asyncIterator]() {
    return this;
  }
}

module.exports = { EventWatch, checkCursor, cursorAfter };
