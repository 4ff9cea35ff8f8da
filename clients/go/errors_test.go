package kvsvc

// The envelope/transport -> class mapping, mirrored from kvsvc/errors/.

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	pb "github.com/kvsvc/kvsvc/clients/go/gen/kvsvc/v1"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func env(typ, reason string, code pb.Code) *pb.RemoteError {
	return &pb.RemoteError{
		EnvelopeVersion: 1, Type: typ, Message: "boom", Code: code, Reason: reason,
		Metadata: map[string]string{"k": "v"}, RequestId: "rid-1",
	}
}

// asClass reports whether errors.As finds the named class in err.
func asClass(err error, name string) bool {
	switch name {
	case "KVServiceError":
		var t *KVServiceError
		return errors.As(err, &t)
	case "InvalidRequest":
		var t *InvalidRequest
		return errors.As(err, &t)
	case "UnsupportedRequest":
		var t *UnsupportedRequest
		return errors.As(err, &t)
	case "MalformedRequest":
		var t *MalformedRequest
		return errors.As(err, &t)
	case "LayoutMismatch":
		var t *LayoutMismatch
		return errors.As(err, &t)
	case "CudaUnavailable":
		var t *CudaUnavailable
		return errors.As(err, &t)
	case "NotFound":
		var t *NotFound
		return errors.As(err, &t)
	case "Miss":
		var t *Miss
		return errors.As(err, &t)
	case "MappingLost":
		var t *MappingLost
		return errors.As(err, &t)
	case "CapacityExhausted":
		var t *CapacityExhausted
		return errors.As(err, &t)
	case "PermissionDenied":
		var t *PermissionDenied
		return errors.As(err, &t)
	case "Unauthenticated":
		var t *Unauthenticated
		return errors.As(err, &t)
	case "Unimplemented":
		var t *Unimplemented
		return errors.As(err, &t)
	case "DeadlineExceeded":
		var t *DeadlineExceeded
		return errors.As(err, &t)
	case "Cancelled":
		var t *Cancelled
		return errors.As(err, &t)
	case "ServiceUnavailable":
		var t *ServiceUnavailable
		return errors.As(err, &t)
	case "ServiceNotServing":
		var t *ServiceNotServing
		return errors.As(err, &t)
	case "TransferUnprovable":
		var t *TransferUnprovable
		return errors.As(err, &t)
	case "RegionUnavailable":
		var t *RegionUnavailable
		return errors.As(err, &t)
	case "RemoteHandlerError":
		var t *RemoteHandlerError
		return errors.As(err, &t)
	case "DataLoss":
		var t *DataLoss
		return errors.As(err, &t)
	case "FatalServerError":
		var t *FatalServerError
		return errors.As(err, &t)
	}
	panic("unknown class " + name)
}

func base(t *testing.T, err error) *KVServiceError {
	t.Helper()
	var e *KVServiceError
	if !errors.As(err, &e) {
		t.Fatalf("%T %v is not a *KVServiceError", err, err)
	}
	return e
}

func TestEveryClassByReasonWithItsAncestors(t *testing.T) {
	ancestors := map[string][]string{
		"UnsupportedRequest": {"InvalidRequest"},
		"MalformedRequest":   {"InvalidRequest"},
		"Miss":               {"NotFound"},
		"MappingLost":        {"NotFound"},
		"DataLoss":           {"RemoteHandlerError"},
		"FatalServerError":   {"RemoteHandlerError"},
	}
	if len(Classes()) != 21 {
		t.Fatalf("%d classes", len(Classes()))
	}
	for _, name := range Classes() {
		reason := classes[name].reason
		// An unknown type and a disagreeing code: the reason decides.
		err := FromRemoteError(env("SomeServerError", reason, pb.Code_CODE_ABORTED), "Lookup")
		if got := fmt.Sprintf("%T", err); got != "*kvsvc."+name {
			t.Errorf("reason %s gave %s", reason, got)
		}
		want := map[string]bool{name: true, "KVServiceError": true}
		for _, a := range ancestors[name] {
			want[a] = true
		}
		for _, other := range append(Classes(), "KVServiceError") {
			if asClass(err, other) != want[other] {
				t.Errorf("%s: errors.As(%s) = %v", name, other, !want[other])
			}
		}
		e := base(t, err)
		if e.Class != name || e.Code != codes.Aborted || e.Reason != reason || e.RequestID != "rid-1" ||
			e.Metadata["k"] != "v" || !e.Remote || e.Method != "Lookup" || e.Type != "SomeServerError" {
			t.Errorf("%s: fields %+v", name, e)
		}
		if status.Code(err) != codes.Aborted {
			t.Errorf("%s: status.Code = %v", name, status.Code(err))
		}
	}
}

func TestUnknownReasonFallsBackToCode(t *testing.T) {
	cases := map[pb.Code]string{
		pb.Code_CODE_INVALID_ARGUMENT:    "*kvsvc.InvalidRequest",
		pb.Code_CODE_FAILED_PRECONDITION: "*kvsvc.LayoutMismatch",
		pb.Code_CODE_NOT_FOUND:           "*kvsvc.NotFound",
		pb.Code_CODE_RESOURCE_EXHAUSTED:  "*kvsvc.CapacityExhausted",
		pb.Code_CODE_UNIMPLEMENTED:       "*kvsvc.Unimplemented",
		pb.Code_CODE_DEADLINE_EXCEEDED:   "*kvsvc.DeadlineExceeded",
		pb.Code_CODE_CANCELLED:           "*kvsvc.Cancelled",
		pb.Code_CODE_UNAVAILABLE:         "*kvsvc.ServiceUnavailable",
		pb.Code_CODE_INTERNAL:            "*kvsvc.RemoteHandlerError",
		pb.Code_CODE_UNKNOWN:             "*kvsvc.RemoteHandlerError",
		pb.Code_CODE_DATA_LOSS:           "*kvsvc.DataLoss",
		pb.Code_CODE_PERMISSION_DENIED:   "*kvsvc.PermissionDenied",
		pb.Code_CODE_UNAUTHENTICATED:     "*kvsvc.Unauthenticated",
		pb.Code_CODE_UNSPECIFIED:         "*kvsvc.KVServiceError",
	}
	for code, want := range cases {
		err := FromRemoteError(env("", "SOMETHING_NEW", code), "Store")
		if got := fmt.Sprintf("%T", err); got != want {
			t.Errorf("%v gave %s, want %s", code, got, want)
		}
		if base(t, err).Reason != "SOMETHING_NEW" {
			t.Errorf("reason lost")
		}
	}
}

func TestTypeNameWinsOverReasonAndCode(t *testing.T) {
	cases := []struct {
		typ, reason string
		code        pb.Code
		want        string
	}{
		{"UnsupportedRequest", "UNSUPPORTED_ENVELOPE_VERSION", pb.Code_CODE_INVALID_ARGUMENT, "*kvsvc.UnsupportedRequest"},
		{"RegionUnavailable", "REGION_TRUNCATED", pb.Code_CODE_FAILED_PRECONDITION, "*kvsvc.RegionUnavailable"},
		{"FatalServerError", "TRANSFER_WORKER_FAILED", pb.Code_CODE_INTERNAL, "*kvsvc.FatalServerError"},
		{"FailpointError", "MAPPING_NOT_FOUND", pb.Code_CODE_INTERNAL, "*kvsvc.MappingLost"},
		{"KVServiceError", "NEW_REASON", pb.Code_CODE_RESOURCE_EXHAUSTED, "*kvsvc.CapacityExhausted"},
	}
	for _, c := range cases {
		err := FromRemoteError(env(c.typ, c.reason, c.code), "Store")
		if got := fmt.Sprintf("%T", err); got != c.want {
			t.Errorf("%s/%s gave %s, want %s", c.typ, c.reason, got, c.want)
		}
		if e := base(t, err); e.Type != c.typ || e.Reason != c.reason {
			t.Errorf("fields lost: %+v", e)
		}
	}
}

func TestTransferStateUnknownIsUnprovable(t *testing.T) {
	e := env("DeadlineExceeded", "FENCE_TIMEOUT", pb.Code_CODE_DEADLINE_EXCEEDED)
	e.TransferState = pb.TransferState_TRANSFER_STATE_UNKNOWN
	err := FromRemoteError(e, "Fence")
	var u *TransferUnprovable
	if !errors.As(err, &u) {
		t.Fatalf("got %T", err)
	}
	if u.Code != codes.DeadlineExceeded || u.Reason != "FENCE_TIMEOUT" || u.BuffersReusable() {
		t.Errorf("fields %+v", u.KVServiceError)
	}
}

func TestUnknownEverythingStillReadable(t *testing.T) {
	e := &pb.RemoteError{
		EnvelopeVersion: 2, Type: "BrandNew", Message: "new", MessageTruncated: true,
		Code: pb.Code(99), Reason: "BRAND_NEW", Metadata: map[string]string{"a": "1"},
		RequestId: "r-9", Retryable: true, TransferState: pb.TransferState(7),
	}
	err := FromRemoteError(e, "Lookup")
	var rh *RemoteHandlerError // an unknown code is UNKNOWN, as in kvsvc.errors
	if !errors.As(err, &rh) {
		t.Fatalf("got %T", err)
	}
	k := base(t, err)
	if k.Code != codes.Code(99) || k.Reason != "BRAND_NEW" || k.Message != "new" || !k.MessageTruncated ||
		k.Metadata["a"] != "1" || k.RequestID != "r-9" || !k.Retryable || k.TransferState != 7 ||
		k.Type != "BrandNew" || k.EnvelopeVersion != 2 {
		t.Errorf("fields %+v", k)
	}
	if got := err.Error(); got != "RemoteHandlerError: new [BRAND_NEW request_id=r-9]" {
		t.Errorf("Error() = %q", got)
	}
}

func TestTransportFailuresMapByCode(t *testing.T) {
	cases := []struct {
		code      codes.Code
		want      string
		retryable bool
	}{
		{codes.Unavailable, "*kvsvc.ServiceUnavailable", true},
		{codes.DeadlineExceeded, "*kvsvc.DeadlineExceeded", false},
		{codes.Canceled, "*kvsvc.Cancelled", false},
		{codes.Unimplemented, "*kvsvc.Unimplemented", false},
		{codes.ResourceExhausted, "*kvsvc.CapacityExhausted", false},
		{codes.Internal, "*kvsvc.KVServiceError", false}, // never RemoteHandlerError: nothing ran
		{codes.Unknown, "*kvsvc.KVServiceError", false},
		{codes.DataLoss, "*kvsvc.DataLoss", false},
		{codes.Unauthenticated, "*kvsvc.Unauthenticated", false},
		{codes.PermissionDenied, "*kvsvc.PermissionDenied", false},
	}
	for _, c := range cases {
		cause := status.Error(c.code, "d")
		err := FromGRPCError(cause, "r", "Lookup", false, false)
		if got := fmt.Sprintf("%T", err); got != c.want {
			t.Errorf("%v gave %s", c.code, got)
		}
		k := base(t, err)
		if k.Reason != "TRANSPORT_"+codeName(c.code) || k.Retryable != c.retryable || k.Remote ||
			k.Metadata["grpcCode"] != codeName(c.code) || k.RequestID != "r" ||
			k.TransferState != pb.TransferState_TRANSFER_STATE_UNSPECIFIED || !errors.Is(err, cause) {
			t.Errorf("%v: fields %+v", c.code, k)
		}
	}
	lost := FromGRPCError(status.Error(codes.Unavailable, "reset"), "t1", "Store", true, true)
	var u *TransferUnprovable
	if !errors.As(lost, &u) || u.Code != codes.Unavailable || u.BuffersReusable() ||
		!strings.Contains(u.Message, "transfer outcome unknown after UNAVAILABLE: reset") {
		t.Errorf("lost reply: %v", lost)
	}
	notSent := FromGRPCError(status.Error(codes.Unavailable, "refused"), "t2", "Store", true, false)
	if k := base(t, notSent); k.Class != "ServiceUnavailable" ||
		k.TransferState != pb.TransferState_TRANSFER_STATE_NOT_STARTED {
		t.Errorf("not sent: %+v", k)
	}
	unimpl := FromGRPCError(status.Error(codes.Unimplemented, "no"), "", "Store", true, true)
	if base(t, unimpl).Class != "Unimplemented" {
		t.Errorf("unimplemented transfer: %v", unimpl)
	}
	refused := FromGRPCError(status.Error(codes.Unauthenticated, "no"), "", "Store", true, true)
	if k := base(t, refused); k.Class != "Unauthenticated" || !k.BuffersReusable() {
		t.Errorf("unauthenticated transfer: %+v", k)
	}
}

func TestTimeoutSettingsAreValidated(t *testing.T) {
	for _, setting := range []string{"TransferTimeout", "ControlTimeout"} {
		for _, bad := range []time.Duration{-1, -time.Second} {
			opts := Options{}
			if setting == "TransferTimeout" {
				opts.TransferTimeout = bad
			} else {
				opts.ControlTimeout = bad
			}
			_, err := New("127.0.0.1:1", opts)
			if !errors.Is(err, ErrInvalidTimeout) || !strings.Contains(err.Error(), setting) {
				t.Errorf("%s=%v: %v", setting, bad, err)
			}
		}
	}
	c := newClient(t, refusedAddress(t), Options{})
	if c.TransferTimeout() != 30*time.Second || c.ControlTimeout() != 5*time.Second {
		t.Errorf("defaults %v %v", c.TransferTimeout(), c.ControlTimeout())
	}
	ctx := ctxFor(t, 10*time.Second)
	// A bad per-call timeout is refused before anything is sent (not ServiceUnavailable).
	for _, bad := range []time.Duration{0, -time.Millisecond} {
		_, err := c.Lookup(ctx, "ns", [][]byte{[]byte("k")}, WithTimeout(bad))
		if !errors.Is(err, ErrInvalidTimeout) || !strings.Contains(err.Error(), "timeout must be > 0") {
			t.Errorf("WithTimeout(%v): %v", bad, err)
		}
	}
	if _, err := c.Store(ctx, "ns", []Chunk{{[]byte("k"), []byte("v")}}, WithTimeout(0)); !errors.Is(err, ErrInvalidTimeout) {
		t.Errorf("Store WithTimeout(0): %v", err)
	}
}

// --- the reason catalogue of kvsvc/errors/ (proto/kvsvc/v1/reasons.json) ---

type catalogueClass struct {
	Name        string `json:"name"`
	Parent      string `json:"parent"`
	Code        string `json:"code"`
	Reason      string `json:"reason"`
	Retryable   bool   `json:"retryable"`
	EveryClient bool   `json:"everyClient"`
}

type catalogueReason struct {
	Name       string `json:"name"`
	Class      string `json:"class"`
	Code       string `json:"code"`
	CodeNumber uint32 `json:"codeNumber"`
	Retryable  bool   `json:"retryable"`
	By         string `json:"by"`
}

type reasonCatalogue struct {
	Classes            []catalogueClass  `json:"classes"`
	DefaultClassByCode map[string]string `json:"defaultClassByCode"`
	Reasons            []catalogueReason `json:"reasons"`
}

// loadCatalogue reads the JSON that scripts/gen_reasons.py makes from kvsvc/errors/.
func loadCatalogue(t *testing.T) reasonCatalogue {
	t.Helper()
	dir := os.Getenv("KVSVC_PROTO_DIR")
	if dir == "" {
		dir = filepath.Join("..", "..", "proto")
	}
	raw, err := os.ReadFile(filepath.Join(dir, "kvsvc", "v1", "reasons.json"))
	if err != nil {
		t.Fatalf("the reason catalogue: %v", err)
	}
	var c reasonCatalogue
	if err := json.Unmarshal(raw, &c); err != nil {
		t.Fatalf("the reason catalogue: %v", err)
	}
	if len(c.Classes) == 0 || len(c.Reasons) == 0 {
		t.Fatalf("the reason catalogue is empty")
	}
	return c
}

func codeByName(t *testing.T, name string) pb.Code {
	t.Helper()
	v, ok := pb.Code_value["CODE_"+name]
	if !ok {
		t.Fatalf("no code %s", name)
	}
	return pb.Code(v)
}

func TestClassesMatchTheReasonCatalogue(t *testing.T) {
	cat := loadCatalogue(t)
	declared := map[string]bool{}
	for _, c := range cat.Classes {
		declared[c.Name] = true
		if c.Name == "KVServiceError" {
			continue
		}
		cl, ok := classes[c.Name]
		if !ok {
			if c.EveryClient {
				t.Errorf("%s (%s) is missing: a server sends it", c.Name, c.Reason)
			}
			continue
		}
		parent := cl.parent
		if parent == "" {
			parent = "KVServiceError"
		}
		if parent != c.Parent || codeName(cl.code) != c.Code || cl.reason != c.Reason ||
			cl.retryable != c.Retryable {
			t.Errorf("%s: parent %s code %s reason %s retryable %v; the catalogue says %+v",
				c.Name, parent, codeName(cl.code), cl.reason, cl.retryable, c)
		}
	}
	for _, name := range Classes() {
		if !declared[name] {
			t.Errorf("%s is not in the catalogue", name)
		}
	}
}

func TestUnknownReasonFallsBackToTheCatalogueDefault(t *testing.T) {
	for code, name := range loadCatalogue(t).DefaultClassByCode {
		err := FromRemoteError(env("NotAClass", "NOT_DECLARED", codeByName(t, code)), "Lookup")
		if got := base(t, err).Class; got != name {
			t.Errorf("%s gave %s, the catalogue says %s", code, got, name)
		}
	}
}

func TestEveryServerReasonComesBackAsItsDeclaredClass(t *testing.T) {
	for _, r := range loadCatalogue(t).Reasons {
		// A bare KVServiceError is never raised by a server (it comes back by its code).
		if r.By != "server" || r.Class == "KVServiceError" {
			continue
		}
		e := env(r.Class, r.Name, codeByName(t, r.Code))
		e.Retryable = r.Retryable
		k := base(t, FromRemoteError(e, "Lookup"))
		if k.Class != r.Class || codeName(k.Code) != r.Code || k.Reason != r.Name || k.Retryable != r.Retryable {
			t.Errorf("%s: got %s %s %s %v; the catalogue says %+v",
				r.Name, k.Class, codeName(k.Code), k.Reason, k.Retryable, r)
		}
		if classes[r.Class].reason == r.Name {
			// A class's own reason finds it even under a type name this client does not know.
			byReason := FromRemoteError(env("NotAClass", r.Name, pb.Code_CODE_ABORTED), "Lookup")
			if got := base(t, byReason).Class; got != r.Class {
				t.Errorf("%s by reason gave %s", r.Name, got)
			}
		}
	}
}

func TestEveryTransportReasonIsTheDeclaredOne(t *testing.T) {
	n := 0
	for _, r := range loadCatalogue(t).Reasons {
		if r.Name != "TRANSPORT_"+r.Code {
			continue
		}
		n++
		err := FromGRPCError(status.Error(codes.Code(r.CodeNumber), "d"), "r", "Lookup", false, false)
		k := base(t, err)
		if k.Class != r.Class || codeName(k.Code) != r.Code || k.Reason != r.Name || k.Retryable != r.Retryable {
			t.Errorf("%s: got %s %s %s %v; the catalogue says %+v",
				r.Name, k.Class, codeName(k.Code), k.Reason, k.Retryable, r)
		}
	}
	if n != 16 {
		t.Errorf("%d transport reasons in the catalogue", n)
	}
}

func TestEveryReasonInTheSourceIsDeclared(t *testing.T) {
	declared := map[string]bool{}
	for _, r := range loadCatalogue(t).Reasons {
		declared[r.Name] = true
	}
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	literal := regexp.MustCompile(`(?:Reason:\s*|codes\.\w+,\s*)"([A-Z][A-Z0-9_]*)"`)
	found := 0
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		src, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range literal.FindAllStringSubmatch(string(src), -1) {
			found++
			if !declared[m[1]] {
				t.Errorf("%s: reason %s is not in kvsvc/errors/'s catalogue", f, m[1])
			}
		}
	}
	if found < 20 {
		t.Errorf("found %d reason literals", found)
	}
}
