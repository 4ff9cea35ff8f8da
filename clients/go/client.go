// Package kvsvc is a thin Go client for kvsvc.v1.KVCacheService: inline
// store/retrieve, lookup, fence, the events stream (events.go), server info
// and grpc.health.v1 checks, with
// a deadline on every call and a typed error (see errors.go) for every
// RemoteError and transport failure.
package kvsvc

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	pb "github.com/kvsvc/kvsvc/clients/go/gen/kvsvc/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/peer"
)

const (
	// DefaultTransferTimeout bounds Store, Retrieve, Unmap and Fence calls
	// whose context has no deadline.
	DefaultTransferTimeout = 30 * time.Second
	// DefaultControlTimeout bounds every other call whose context has no deadline.
	DefaultControlTimeout = 5 * time.Second
	// HealthServiceName is the grpc.health.v1 name of the service ("" is the whole server).
	HealthServiceName = "kvsvc.v1.KVCacheService"
	// maxMessageBytes is the server's limit too (kvsvc/config.py).
	maxMessageBytes = 256 << 20
)

// ErrInvalidTimeout is wrapped by the error for a timeout setting that is not > 0.
var ErrInvalidTimeout = errors.New("kvsvc: invalid timeout")

// ValidateTimeout accepts a timeout > 0; the error names the setting.
func ValidateTimeout(d time.Duration, setting string) error {
	if d <= 0 {
		return fmt.Errorf("%w: %s must be > 0, got %v", ErrInvalidTimeout, setting, d)
	}
	return nil
}

// Options configure a Client. Zero values mean the defaults.
type Options struct {
	// TransferTimeout for Store/Retrieve/Unmap/Fence without a context deadline (0: 30 s).
	TransferTimeout time.Duration
	// ControlTimeout for every other call without a context deadline (0: 5 s).
	ControlTimeout time.Duration
	// Token is the bearer token of a server with --auth-token-file, sent as
	// "authorization: Bearer <token>" metadata on every call ("": none).
	Token string
	// TLS, when set, makes the connection TLS with this configuration: the
	// server's CA in RootCAs, a client certificate in Certificates for mTLS,
	// ServerName when it differs from the target's host. Nil: plaintext.
	TLS *tls.Config
	// DialOptions are appended to the defaults (plaintext or TLS, 256 MiB
	// messages, keepalive the server permits).
	DialOptions []grpc.DialOption
	// FdSocket is the server's fd socket as this process sees it, when not
	// where the server says (another container mounts the socket directory
	// elsewhere).
	FdSocket string
	// DisableSession sends Lookup, Store, Retrieve and Fence as unary calls.
	// By default they travel on one Session stream (opened at the first call,
	// opened again after a break), and as unary calls to a server that
	// answers that it has no Session RPC.
	DisableSession bool
}

// bearer sends a token with every call; plaintext is allowed (loopback and unix
// sockets serve it), so it does not require transport security itself.
type bearer string

func (b bearer) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": "Bearer " + string(b)}, nil
}

func (b bearer) RequireTransportSecurity() bool { return false }

// Client is safe for concurrent use.
type Client struct {
	conn            *grpc.ClientConn
	kv              pb.KVCacheServiceClient
	health          healthpb.HealthClient
	transferTimeout time.Duration
	controlTimeout  time.Duration
	fdSocket        string
	lease           *fdLease

	sessMu    sync.Mutex
	sess      *session // nil until the first call that uses it
	unaryOnly bool     // DisableSession, or the server has no Session RPC
	closed    bool
}

// New creates a client for target ("host:port"); it connects lazily, so a
// server that cannot be reached shows up as ServiceUnavailable on the first call.
func New(target string, opts Options) (*Client, error) {
	c := &Client{
		transferTimeout: opts.TransferTimeout,
		controlTimeout:  opts.ControlTimeout,
		fdSocket:        opts.FdSocket,
		lease:           &fdLease{},
		unaryOnly:       opts.DisableSession,
	}
	if c.transferTimeout == 0 {
		c.transferTimeout = DefaultTransferTimeout
	}
	if c.controlTimeout == 0 {
		c.controlTimeout = DefaultControlTimeout
	}
	if err := ValidateTimeout(c.transferTimeout, "TransferTimeout"); err != nil {
		return nil, err
	}
	if err := ValidateTimeout(c.controlTimeout, "ControlTimeout"); err != nil {
		return nil, err
	}
	transport := grpc.WithInsecure()
	if opts.TLS != nil {
		transport = grpc.WithTransportCredentials(credentials.NewTLS(opts.TLS))
	}
	dial := []grpc.DialOption{
		transport,
		grpc.WithDefaultCallOptions(
			grpc.MaxCallRecvMsgSize(maxMessageBytes), grpc.MaxCallSendMsgSize(maxMessageBytes)),
		grpc.WithKeepaliveParams(keepalive.ClientParameters{
			Time: 30 * time.Second, Timeout: 10 * time.Second, PermitWithoutStream: false,
		}),
	}
	if opts.Token != "" {
		if strings.ContainsAny(opts.Token, " \t\r\n") {
			return nil, errors.New("kvsvc: Token must not contain whitespace")
		}
		dial = append(dial, grpc.WithPerRPCCredentials(bearer(opts.Token)))
	}
	conn, err := grpc.Dial(target, append(dial, opts.DialOptions...)...)
	if err != nil {
		return nil, FromGRPCError(err, "", "Dial", false, false)
	}
	c.conn = conn
	c.kv = pb.NewKVCacheServiceClient(conn)
	c.health = healthpb.NewHealthClient(conn)
	return c, nil
}

// Close ends the client's session (its pending calls fail as Cancelled), its
// fd lease (the server releases the mappings of the memfds passed through it)
// and its connection.
func (c *Client) Close() error {
	c.sessMu.Lock()
	c.closed = true
	s := c.sess
	c.sessMu.Unlock()
	if s != nil {
		s.close()
	}
	c.lease.close()
	return c.conn.Close()
}

// TransferTimeout is the default timeout of transfer calls.
func (c *Client) TransferTimeout() time.Duration { return c.transferTimeout }

// ControlTimeout is the default timeout of control calls.
func (c *Client) ControlTimeout() time.Duration { return c.controlTimeout }

// CallOption adjusts one call.
type CallOption func(*callOptions)

type callOptions struct {
	timeout    time.Duration
	timeoutSet bool
	requestID  string
}

// WithTimeout bounds this call (together with the context's own deadline);
// it must be > 0.
func WithTimeout(d time.Duration) CallOption {
	return func(o *callOptions) { o.timeout = d; o.timeoutSet = true }
}

// WithRequestID sets the request id; for a transfer it is the transfer id that
// Fence takes. By default a random one is used.
func WithRequestID(id string) CallOption { return func(o *callOptions) { o.requestID = id } }

// Chunk is one inline chunk: a key and its bytes.
type Chunk struct {
	Key  []byte
	Data []byte
}

// plan is one prepared call.
type plan struct {
	method   string
	long     bool // transfer timeout by default
	transfer bool // a copy between mapped blocks and the store
	header   *pb.RequestHeader
	opts     callOptions
}

func newRequestID() string {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic(err)
	}
	return hex.EncodeToString(b[:])
}

// prepare fills the request header (envelope version, request id) in place.
func prepare(method string, long, transfer bool, header **pb.RequestHeader, opts []CallOption) (*plan, error) {
	p := &plan{method: method, long: long, transfer: transfer}
	for _, o := range opts {
		o(&p.opts)
	}
	if p.opts.timeoutSet {
		if err := ValidateTimeout(p.opts.timeout, "timeout"); err != nil {
			return nil, err
		}
	}
	if *header == nil {
		*header = &pb.RequestHeader{}
	}
	h := *header
	if h.EnvelopeVersion == 0 {
		h.EnvelopeVersion = EnvelopeVersion
	}
	if p.opts.requestID != "" {
		h.RequestId = p.opts.requestID
	}
	if h.RequestId == "" {
		h.RequestId = newRequestID()
	}
	p.header = h
	return p, nil
}

func (c *Client) deadline(ctx context.Context, p *plan) (context.Context, context.CancelFunc) {
	if p.opts.timeoutSet {
		return context.WithTimeout(ctx, p.opts.timeout)
	}
	if _, ok := ctx.Deadline(); ok {
		return context.WithCancel(ctx)
	}
	if p.long {
		return context.WithTimeout(ctx, c.transferTimeout)
	}
	return context.WithTimeout(ctx, c.controlTimeout)
}

type response[R comparable] interface {
	GetError() *pb.RemoteError
	GetResult() R
}

// unary runs one call (on the session when k is not nil and the client uses
// one) and turns every failure into a typed error.
func unary[R comparable, Resp response[R]](
	c *Client, ctx context.Context, p *plan,
	rpc func(context.Context, ...grpc.CallOption) (Resp, error),
	k *carried[Resp],
) (R, error) {
	var zero R
	ctx, cancel := c.deadline(ctx, p)
	defer cancel()
	if k != nil {
		if r, used, err := overSession[R, Resp](c, ctx, p, k); used {
			return r, err
		}
	}
	// The peer is known only once a stream was opened on a connection: then the
	// request may have reached the server.
	var remote peer.Peer
	resp, err := rpc(ctx, grpc.Peer(&remote))
	if err != nil {
		return zero, FromGRPCError(err, p.header.RequestId, p.method, p.transfer, remote.Addr != nil)
	}
	return settle[R, Resp](p, resp)
}

// settle is a response's result, or its RemoteError (or EMPTY_RESPONSE) as a typed error.
func settle[R comparable, Resp response[R]](p *plan, resp Resp) (R, error) {
	var zero R
	if env := resp.GetError(); env != nil {
		return zero, FromRemoteError(env, p.method)
	}
	r := resp.GetResult()
	if r == zero {
		state := pb.TransferState_TRANSFER_STATE_UNSPECIFIED
		if p.transfer {
			state = pb.TransferState_TRANSFER_STATE_UNKNOWN
		}
		return zero, build("", &KVServiceError{
			Message:       p.method + " response carries neither result nor error (newer server?)",
			Reason:        "EMPTY_RESPONSE",
			RequestID:     p.header.RequestId,
			Method:        p.method,
			TransferState: state,
		})
	}
	return r, nil
}

// Store stores chunks sent inline under keys of a namespace; keys already
// present are skipped (PresentChunks).
func (c *Client) Store(ctx context.Context, namespace string, chunks []Chunk, opts ...CallOption) (*pb.StoreResult, error) {
	inline := &pb.InlineChunks{Namespace: namespace}
	for _, ch := range chunks {
		inline.Chunks = append(inline.Chunks, &pb.InlineChunk{Key: ch.Key, Data: ch.Data})
	}
	return c.StoreRaw(ctx, &pb.StoreRequest{Source: &pb.StoreRequest_Inline{Inline: inline}}, opts...)
}

// Retrieve returns the leading present chunks of keys; loading stops at the first miss.
func (c *Client) Retrieve(ctx context.Context, namespace string, keys [][]byte, opts ...CallOption) (*pb.RetrieveResult, error) {
	req := &pb.RetrieveRequest{Target: &pb.RetrieveRequest_Inline{
		Inline: &pb.InlineKeys{Namespace: namespace, Keys: keys}}}
	return c.RetrieveRaw(ctx, req, opts...)
}

// Lookup counts the leading keys present in a namespace, in any layout.
func (c *Client) Lookup(ctx context.Context, namespace string, keys [][]byte, opts ...CallOption) (*pb.LookupResult, error) {
	return c.LookupRaw(ctx, &pb.LookupRequest{Scope: &pb.LookupRequest_Namespace{Namespace: namespace}, Keys: keys}, opts...)
}

// LookupMapping counts the leading keys present in a mapping's layout.
func (c *Client) LookupMapping(ctx context.Context, mappingID string, keys [][]byte, opts ...CallOption) (*pb.LookupResult, error) {
	return c.LookupRaw(ctx, &pb.LookupRequest{Scope: &pb.LookupRequest_MappingId{MappingId: mappingID}, Keys: keys}, opts...)
}

// Fence returns once no copy of the mapping (if not "") or of the listed
// transfers is running; ids the server never saw are barred from ever starting.
func (c *Client) Fence(ctx context.Context, mappingID string, transferIDs []string, opts ...CallOption) (*pb.FenceResult, error) {
	req := &pb.FenceRequest{MappingId: mappingID, TransferIds: transferIDs}
	p, err := prepare("Fence", true, false, &req.Header, opts)
	if err != nil {
		return nil, err
	}
	return unary[*pb.FenceResult, *pb.FenceResponse](c, ctx, p, func(ctx context.Context, o ...grpc.CallOption) (*pb.FenceResponse, error) {
		return c.kv.Fence(ctx, req, o...)
	}, &carried[*pb.FenceResponse]{
		req:    &pb.SessionRequest{Request: &pb.SessionRequest_Fence{Fence: req}},
		unwrap: (*pb.SessionResponse).GetFence,
	})
}

// ServerInfo reports version, restart identity, capacity, usage and health.
func (c *Client) ServerInfo(ctx context.Context, opts ...CallOption) (*pb.GetServerInfoResult, error) {
	req := &pb.GetServerInfoRequest{}
	p, err := prepare("GetServerInfo", false, false, &req.Header, opts)
	if err != nil {
		return nil, err
	}
	return unary[*pb.GetServerInfoResult, *pb.GetServerInfoResponse](c, ctx, p, func(ctx context.Context, o ...grpc.CallOption) (*pb.GetServerInfoResponse, error) {
		return c.kv.GetServerInfo(ctx, req, o...)
	}, nil)
}

// HealthCheck asks grpc.health.v1 about service ("" or HealthServiceName).
func (c *Client) HealthCheck(ctx context.Context, service string, opts ...CallOption) (healthpb.HealthCheckResponse_ServingStatus, error) {
	var header *pb.RequestHeader
	p, err := prepare("Health.Check", false, false, &header, opts)
	if err != nil {
		return healthpb.HealthCheckResponse_UNKNOWN, err
	}
	ctx, cancel := c.deadline(ctx, p)
	defer cancel()
	resp, err := c.health.Check(ctx, &healthpb.HealthCheckRequest{Service: service})
	if err != nil {
		return healthpb.HealthCheckResponse_UNKNOWN, FromGRPCError(err, "", p.method, false, false)
	}
	return resp.GetStatus(), nil
}

// Map maps the KV tensors of one engine's ranks (all or none).
func (c *Client) Map(ctx context.Context, req *pb.MapRequest, opts ...CallOption) (*pb.MapResult, error) {
	p, err := prepare("Map", false, false, &req.Header, opts)
	if err != nil {
		return nil, err
	}
	return unary[*pb.MapResult, *pb.MapResponse](c, ctx, p, func(ctx context.Context, o ...grpc.CallOption) (*pb.MapResponse, error) {
		return c.kv.Map(ctx, req, o...)
	}, nil)
}

// Unmap fences a mapping's copies and releases it.
func (c *Client) Unmap(ctx context.Context, mappingID string, opts ...CallOption) (*pb.UnmapResult, error) {
	req := &pb.UnmapRequest{MappingId: mappingID}
	p, err := prepare("Unmap", true, false, &req.Header, opts)
	if err != nil {
		return nil, err
	}
	return unary[*pb.UnmapResult, *pb.UnmapResponse](c, ctx, p, func(ctx context.Context, o ...grpc.CallOption) (*pb.UnmapResponse, error) {
		return c.kv.Unmap(ctx, req, o...)
	}, nil)
}

// StoreRaw sends a StoreRequest as given (its header is filled in place). A
// block Store whose reply is lost after it may have reached the server fails
// with *TransferUnprovable: fence its request id before reusing the blocks.
func (c *Client) StoreRaw(ctx context.Context, req *pb.StoreRequest, opts ...CallOption) (*pb.StoreResult, error) {
	p, err := prepare("Store", true, req.GetBlocks() != nil, &req.Header, opts)
	if err != nil {
		return nil, err
	}
	return unary[*pb.StoreResult, *pb.StoreResponse](c, ctx, p, func(ctx context.Context, o ...grpc.CallOption) (*pb.StoreResponse, error) {
		return c.kv.Store(ctx, req, o...)
	}, &carried[*pb.StoreResponse]{
		req:    &pb.SessionRequest{Request: &pb.SessionRequest_Store{Store: req}},
		unwrap: (*pb.SessionResponse).GetStore,
	})
}

// RetrieveRaw sends a RetrieveRequest as given (its header is filled in place).
func (c *Client) RetrieveRaw(ctx context.Context, req *pb.RetrieveRequest, opts ...CallOption) (*pb.RetrieveResult, error) {
	p, err := prepare("Retrieve", true, req.GetBlocks() != nil, &req.Header, opts)
	if err != nil {
		return nil, err
	}
	return unary[*pb.RetrieveResult, *pb.RetrieveResponse](c, ctx, p, func(ctx context.Context, o ...grpc.CallOption) (*pb.RetrieveResponse, error) {
		return c.kv.Retrieve(ctx, req, o...)
	}, &carried[*pb.RetrieveResponse]{
		req:    &pb.SessionRequest{Request: &pb.SessionRequest_Retrieve{Retrieve: req}},
		unwrap: (*pb.SessionResponse).GetRetrieve,
	})
}

// LookupRaw sends a LookupRequest as given (its header is filled in place).
func (c *Client) LookupRaw(ctx context.Context, req *pb.LookupRequest, opts ...CallOption) (*pb.LookupResult, error) {
	p, err := prepare("Lookup", false, false, &req.Header, opts)
	if err != nil {
		return nil, err
	}
	return unary[*pb.LookupResult, *pb.LookupResponse](c, ctx, p, func(ctx context.Context, o ...grpc.CallOption) (*pb.LookupResponse, error) {
		return c.kv.Lookup(ctx, req, o...)
	}, &carried[*pb.LookupResponse]{
		req:    &pb.SessionRequest{Request: &pb.SessionRequest_Lookup{Lookup: req}},
		unwrap: (*pb.SessionResponse).GetLookup,
	})
}
