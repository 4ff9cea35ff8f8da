// Types of the kvsvc Node.js client (src/index.js, src/events.js, src/errors.js).
import type { ChannelCredentials, ServiceError } from '@grpc/grpc-js';

export type Bytes = Buffer | Uint8Array | string;
export type TransferState = 'UNSPECIFIED' | 'NOT_STARTED' | 'FINISHED' | 'UNKNOWN' | string;
export type ServingStatus = 'SERVING' | 'NOT_SERVING' | 'UNKNOWN' | 'SERVICE_UNKNOWN';

export interface ClientOptions {
  /** Default seconds for Store/Retrieve/Unmap/Fence (30). */
  transferDeadline?: number;
  /** Default seconds for every other call (5). */
  controlDeadline?: number;
  credentials?: ChannelCredentials;
  /** Bearer token of a server with --auth-token-file (sent on every call, never logged). */
  token?: string;
  /** TLS: server CA, client certificate/key for mTLS (Buffers, PEM text or file paths). */
  tls?: { ca?: Buffer | string; cert?: Buffer | string; key?: Buffer | string; serverName?: string };
  channelOptions?: Record<string, unknown>;
  /** Directory holding kvsvc/v1/*.proto (default: the repository's proto/, or $KVSVC_PROTO_DIR). */
  protoDir?: string;
  /** Lookup/Store/Retrieve/Fence on one Session stream (true), or unary calls only (false). */
  session?: boolean;
}

export interface CallOptions {
  /** Seconds; a finite number > 0. */
  deadline?: number;
  signal?: AbortSignal;
}

export interface TransferOptions extends CallOptions {
  /** Request id; the transfer id that Fence takes. Random by default. */
  requestId?: string;
}

export interface StoreResult {
  storedChunks: number;
  presentChunks: number;
  evictedChunks: number;
  storedBytes: number;
  transferId: string;
  serverStartId: string;
}

export interface RetrieveResult {
  loadedChunks: number;
  chunks: Array<{ key: Buffer; data: Buffer }>;
  loadedBytes: number;
  transferId: string;
  serverStartId: string;
}

export interface LookupResult {
  hitChunks: number;
  serverStartId: string;
}

export interface FenceResult {
  waitedTransfers: number;
  barredTransfers: number;
  serverStartId: string;
}

export interface ServerInfo {
  version: string;
  envelopeVersion: number;
  serverStartId: string;
  capacityBytes: number;
  usedBytes: number;
  storedChunks: number;
  evictedChunks: number;
  mappings: number;
  inflightTransfers: number;
  serving: boolean;
  failureReason: string;
  failureTime: Date | null;
  startTime: Date | null;
  device: string;
}

export interface EventCursor {
  /** The server_start_id of the incarnation the sequence belongs to. */
  incarnation: string;
  /** Sequence of the last event applied. */
  sequence: number;
}

export interface StoredEvent {
  namespace: string;
  keys: Buffer[];
  /** Layout fingerprint ("inline" for inline stores). */
  layout: string;
  bytes: number;
  tier: 'TIER_UNSPECIFIED' | 'TIER_MEMORY' | 'TIER_REDIS' | 'TIER_DISK' | 'TIER_S3' | 'TIER_MOONCAKE' | string;
}

export interface RemovedEvent {
  namespace: string;
  keys: Buffer[];
  layout: string;
  reason: 'REMOVAL_REASON_UNSPECIFIED' | 'REMOVAL_REASON_EVICTED' | 'REMOVAL_REASON_UNMAPPED'
    | 'REMOVAL_REASON_OVERWRITTEN' | 'REMOVAL_REASON_CHECK_FAILED' | 'REMOVAL_REASON_TIER_DROPPED' | 'REMOVAL_REASON_DROPPED' | string;
  tier: StoredEvent['tier'];
}

export interface ClearedEvent {
  reason: 'CLEAR_REASON_UNSPECIFIED' | 'CLEAR_REASON_START' | 'CLEAR_REASON_FATAL' | 'CLEAR_REASON_OPERATOR' | string;
}

export type KVEvent =
  | { kind: 'stored'; stored: StoredEvent }
  | { kind: 'removed'; removed: RemovedEvent }
  | { kind: 'cleared'; cleared: ClearedEvent };

export interface EventBatch {
  incarnation: string;
  /** The last event's number; for snapshot batches, the snapshot point. */
  sequence: number;
  events: KVEvent[];
  /** Drop everything known of the watched namespaces: snapshot batches follow. */
  lost: boolean;
  snapshot: boolean;
  snapshotDone: boolean;
  /** Where a caller that applied every batch so far stands; null inside a resync. */
  cursor: EventCursor | null;
}

export interface WatchOptions {
  /** Namespaces to follow; empty: every namespace the caller may see. */
  namespaces?: string[];
  /** Resume after this point; null/absent: `lost` and a snapshot first. */
  cursor?: EventCursor | null;
  /** Most keys in one snapshot batch (0: the server's default). */
  snapshotPageKeys?: number;
  /** Seconds for the stream's whole life (default: none). */
  deadline?: number;
  signal?: AbortSignal;
  requestId?: string;
}

/** An open WatchEvents stream: `for await (const batch of watch)`. */
export class EventWatch implements AsyncIterableIterator<EventBatch> {
  /** Where the caller stands after the last batch handed out (null: resync from a snapshot). */
  readonly cursor: EventCursor | null;
  readonly requestId: string;
  /** Ends the stream; an iteration in progress ends without an error. */
  close(): void;
  next(): Promise<IteratorResult<EventBatch>>;
  return(): Promise<IteratorResult<EventBatch>>;
  [Symbol.asyncIterator](): EventWatch;
}

export class KVClient {
  constructor(address: string, options?: ClientOptions);
  readonly address: string;
  readonly transferDeadline: number;
  readonly controlDeadline: number;
  /** False once unary only: `session: false`, or the server has no Session RPC. */
  readonly useSession: boolean;
  close(): void;
  store(namespace: string, chunks: Array<{ key: Bytes; data: Bytes }>, opts?: TransferOptions): Promise<StoreResult>;
  retrieve(namespace: string, keys: Bytes[], opts?: TransferOptions): Promise<RetrieveResult>;
  lookup(scope: string | { namespace: string } | { mappingId: string }, keys: Bytes[], opts?: CallOptions): Promise<LookupResult>;
  fence(what: { mappingId?: string; transferIds?: string[] }, opts?: CallOptions): Promise<FenceResult>;
  serverInfo(opts?: CallOptions): Promise<ServerInfo>;
  healthCheck(service?: string, opts?: CallOptions): Promise<ServingStatus>;
  /** Follow the server's stored/removed/cleared events (WatchEvents). */
  watchEvents(opts?: WatchOptions): EventWatch;
  /** Any KVCacheService RPC, request in proto-loader form (camelCase, Buffers). */
  call(method: 'Map' | 'Unmap' | 'Store' | 'Retrieve' | 'Lookup' | 'Fence' | 'GetServerInfo',
    request?: Record<string, unknown>, opts?: CallOptions): Promise<any>;
}

export function validateDeadline(value: unknown, setting: string): number;
export const DEFAULT_TRANSFER_DEADLINE_S: number;
export const DEFAULT_CONTROL_DEADLINE_S: number;
export const HEALTH_SERVICE_NAME: string;
export const ENVELOPE_VERSION: number;

export class KVServiceError extends Error {
  /** gRPC code name, e.g. "NOT_FOUND" ("UNKNOWN" for a number this client does not know). */
  code: string;
  /** The numeric code as received. */
  codeNumber: number;
  reason: string;
  metadata: Record<string, string>;
  requestId: string;
  retryable: boolean;
  transferState: TransferState;
  /** Class name of the exception raised on the server. */
  type: string;
  messageTruncated: boolean;
  /** True for an in-band RemoteError, false for a transport failure. */
  remote: boolean;
  method: string;
  envelopeVersion: number;
  /** False while a copy may still be writing the caller's buffers (transferState UNKNOWN). */
  readonly buffersReusable: boolean;
  static code: string;
  static reason: string;
  toJSON(): Record<string, unknown>;
}
export class InvalidRequest extends KVServiceError {}
export class UnsupportedRequest extends InvalidRequest {}
export class MalformedRequest extends InvalidRequest {}
export class LayoutMismatch extends KVServiceError {}
export class NotFound extends KVServiceError {}
export class Miss extends NotFound {}
export class MappingLost extends NotFound {}
export class CudaUnavailable extends KVServiceError {}
export class CapacityExhausted extends KVServiceError {}
export class PermissionDenied extends KVServiceError {}
export class Unauthenticated extends KVServiceError {}
export class Unimplemented extends KVServiceError {}
export class DeadlineExceeded extends KVServiceError {}
export class Cancelled extends KVServiceError {}
export class ServiceUnavailable extends KVServiceError {}
export class ServiceNotServing extends KVServiceError {}
export class TransferUnprovable extends KVServiceError {}
export class RegionUnavailable extends KVServiceError {}
export class RemoteHandlerError extends KVServiceError {}
export class DataLoss extends RemoteHandlerError {}
export class FatalServerError extends RemoteHandlerError {}
export const CLASSES: Array<typeof KVServiceError>;

export function fromRemoteError(err: Record<string, unknown>, context?: { method?: string }): KVServiceError;
export function fromGrpcError(err: Partial<ServiceError>, context?: {
  requestId?: string; method?: string; transfer?: boolean; transferStarted?: boolean;
}): KVServiceError;
