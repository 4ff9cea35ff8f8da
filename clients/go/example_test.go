package kvsvc_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"time"

	kvsvc "github.com/kvsvc/kvsvc/clients/go"
)

// The README's example (compiled by go vet and go test; the same calls run
// against a live server in TestRoundTripIsBitExact).
func Example() {
	c, err := kvsvc.New("127.0.0.1:50051", kvsvc.Options{TransferTimeout: 30 * time.Second})
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	keys := [][]byte{[]byte("prefix-hash-0"), []byte("prefix-hash-1")}
	chunks := []kvsvc.Chunk{{Key: keys[0], Data: make([]byte, 4096)}, {Key: keys[1], Data: make([]byte, 4096)}}
	if _, err := c.Store(ctx, "llama-3-8b/fp16", chunks); err != nil {
		log.Fatal(err)
	}
	hits, _ := c.Lookup(ctx, "llama-3-8b/fp16", keys)
	got, err := c.Retrieve(ctx, "llama-3-8b/fp16", keys)
	var lost *kvsvc.MappingLost
	if errors.As(err, &lost) {
		log.Fatal("map again: ", lost.Metadata["mappingId"])
	}
	fmt.Println(hits.HitChunks, got.LoadedChunks)
}
